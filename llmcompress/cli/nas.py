"""`llmcompress nas` (placeholder until its engine lands)."""

from __future__ import annotations

import typer

from llmcompress.errors import UserError


def nas_command(ctx: typer.Context) -> None:
    """Not implemented yet."""
    raise UserError("'llmcompress nas' is not implemented yet", "see the project's issues for its status")
