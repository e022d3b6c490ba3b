"""`flyspec models list` and `flyspec models prepare NAME`: the offline model zoo (flyspec/assets.py)."""

from __future__ import annotations

import json

import typer

from flyspec.cli.options import JsonFlag

models_app = typer.Typer(
    help="The offline model zoo: list its models and prepare them (assemble, verify sha256, convert to "
    "bfloat16 safetensors) into the local cache ($FLYSPEC_CACHE, default ~/.cache/flyspec).",
    no_args_is_help=True,
)

_UNBOUNDED_WIDTH = 10_000


@models_app.command("list")
def list_models(json_output: JsonFlag = False) -> None:
    """Show each zoo model: role, size, whether its packages are installed and whether it is prepared."""
    from rich.console import Console
    from rich.table import Table

    from flyspec.assets import ZOO, cache_dir, is_prepared, missing_packages, model_dir

    rows = []
    for entry in ZOO.values():
        missing = missing_packages(entry)
        rows.append(
            {
                "name": entry.name,
                "role": entry.role,
                "size": entry.size,
                "description": entry.description,
                "packages_installed": not missing,
                "missing_packages": missing,
                "install": entry.install_hint,
                "prepared": is_prepared(entry.name),
                "path": str(model_dir(entry.name)),
            }
        )
    if json_output:
        print(json.dumps({"cache": str(cache_dir()), "models": rows}))
        return
    table = Table(title=f"flyspec model zoo (cache: {cache_dir()})")
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
        prepared = "yes" if row["prepared"] else "no: flyspec models prepare " + row["name"]
        table.add_row(row["name"], row["role"], row["size"], packages, prepared)
    console = Console()
    if not console.is_terminal:
        # A pipe or a file has no width: rich would assume 80 columns and squeeze the table. Give each
        # model one whole line instead, so `flyspec models list | grep NAME` shows all of it.
        console = Console(width=_UNBOUNDED_WIDTH)
    console.print(table)


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
