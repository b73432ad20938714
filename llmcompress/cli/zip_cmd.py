"""placeholder"""

from __future__ import annotations

import typer

from llmcompress.errors import UserError


def collapse_command(ctx: typer.Context) -> None:
    """Not implemented yet."""
    raise UserError("not implemented yet", "see the project's issues for its status")


zip_command = unzip_command = collapse_command
