"""`llmcompress verify CHECKPOINT`: compare each file with the sha256 its llmcompress.json recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def verify_command(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint directory written by llmcompress (collapse, distill, nas).")],
) -> None:
    """Check a checkpoint's files against the digests in its manifest (catches bit flips and edits)."""
    from llmcompress.errors import UserError
    from llmcompress.io.checkpoint import verify_checkpoint

    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint} is not a directory", "pass a checkpoint directory written by llmcompress")
    stats = verify_checkpoint(checkpoint)
    typer.echo(f"ok: {stats['files']} file(s), {stats['bytes'] / 1e6:.1f} MB in {checkpoint} match their digests")
