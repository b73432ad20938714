"""`llmcompress data list | fetch NAME | add NAME PATH`: what named datasets this machine has, and getting more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help="Named datasets: list what is here, fetch from the hub, register local copies.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the catalog as JSON.")] = False,
) -> None:
    """Each named dataset, its splits, and where each was found (registry, data directory) or that it is missing."""
    from llmcompress.data.catalog import registry_path, status
    from llmcompress.data.sources import how_to_get
    from llmcompress.paths import data_dir

    records = status()
    if as_json:
        typer.echo(json.dumps({"data_dir": str(data_dir()), "registry": str(registry_path()), "datasets": records}, indent=2))
        return
    typer.echo(f"data directory: {data_dir()} (LLMCOMPRESS_DATA_DIR overrides)")
    for r in records:
        hub = f"hub: {r['hub']}" if r["hub"] else "not on the hub"
        typer.echo(f"{r['name']}  ({hub}{', registered' if r['registered'] else ''})")
        for split, s in r["splits"].items():
            where = f"{s['found']}  [{s['via']}]" if s["found"] else "missing"
            typer.echo(f"  {split:<15} {where}")
        if any(s["found"] is None for s in r["splits"].values()) and r["name"] in ("wikitext2", "tinyshakespeare", "piqa"):
            typer.echo(f"  to get it: {how_to_get(r['name'])}")


@app.command("fetch")
def fetch_command(name: Annotated[str, typer.Argument(help="Dataset to download: wikitext2 or piqa.")]) -> None:
    """Download a named dataset from the Hugging Face hub into the data directory (needs the network)."""
    from llmcompress.data.catalog import fetch

    for path in fetch(name):
        typer.echo(f"wrote {path}")


@app.command("add")
def add_command(
    name: Annotated[str, typer.Argument(help="Name to use in --data/--ppl (a known dataset, or a new name).")],
    path: Annotated[Path, typer.Argument(help="A .txt/.jsonl file, or a folder of them.")],
    split: Annotated[Optional[str], typer.Option("--split", help="Split the file serves (default: the dataset's default, or `all`).")] = None,
) -> None:
    """Register a local file or folder under a name; named-dataset lookups then read it."""
    from llmcompress.data.catalog import add, registry_path

    entry = add(name, path, split)
    for s, p in entry.items():
        typer.echo(f"{name}:{s} -> {p}")
    typer.echo(f"registered in {registry_path()}")
