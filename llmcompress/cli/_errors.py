"""Turn typed errors into one line and exit code 2 (full traceback only with --debug)."""

from __future__ import annotations

import os
import signal
import sys


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LLMCOMPRESS_DEBUG") == "1"


def run_app(app, argv: list[str] | None = None) -> int:
    from llmcompress.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    previous = _sigterm_interrupts()
    try:
        app(args=argv, prog_name="llmcompress", standalone_mode=False)
        return 0
    except UserError as exc:
        if _debug(argv):
            raise
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: outputs written so far are complete; rerun with --resume to continue", file=sys.stderr)
        return 130
    except Exception as exc:  # click usage errors and friends (typer may vendor its own click)
        name = type(exc).__name__
        if name == "Exit" and hasattr(exc, "exit_code"):
            return exc.exit_code
        if name == "Abort":
            return 130
        if name == "NoArgsIsHelpError":
            print(exc.format_message())
            return 2
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            usage = getattr(getattr(exc, "ctx", None), "command_path", "llmcompress")
            print(f"error: {exc.format_message().rstrip('.')}. see '{usage} --help'", file=sys.stderr)
            return 2
        if _debug(argv):
            raise
        print(f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_interrupts():
    """SIGTERM (kill, a scheduler's time limit) unwinds like Ctrl-C, so cleanup runs (spilled caches, temp
    files) and the same resume message is printed. Returns the previous handler (None off the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread of the main interpreter
        return None
