"""The `llmcompress` command line: a thin Typer shell over the library.

Each command lives in its own module and imports torch/transformers only inside its body, so
`llmcompress --help` stays fast. Errors of type `UserError` become one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys

import typer

from llmcompress import __version__

app = typer.Typer(
    name="llmcompress",
    help="Make pretrained causal LLMs smaller and faster, and prove it with measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmcompress {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    if debug:
        os.environ["LLMCOMPRESS_DEBUG"] = "1"


def _register() -> None:
    from llmcompress.cli import collapse, distill, eval_cmd, export, info, nas, zip_cmd

    app.command("eval")(eval_cmd.eval_command)
    app.command("info")(info.info_command)
    app.command("collapse")(collapse.collapse_command)
    app.command("distill")(distill.distill_command)
    app.command("nas")(nas.nas_command)
    app.command("export")(export.export_command)
    app.command("zip")(zip_cmd.zip_command)
    app.command("unzip")(zip_cmd.unzip_command)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from llmcompress.cli._errors import run_app

    sys.exit(run_app(app, argv))
