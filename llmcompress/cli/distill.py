"""`llmcompress distill` (placeholder until its engine lands)."""

from __future__ import annotations

import typer

from llmcompress.errors import UserError


def distill_command(ctx: typer.Context) -> None:
    """Not implemented yet."""
    raise UserError("'llmcompress distill' is not implemented yet", "see the project's issues for its status")
