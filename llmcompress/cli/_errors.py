"""Turn typed errors into one line and exit code 2 (full traceback only with --debug), and interrupts
(Ctrl-C, SIGTERM) into exit code 130 with one line saying what was kept and how to continue."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

INTERRUPTED = 130  # 128 + SIGINT, for Ctrl-C and SIGTERM alike: never 0, so a scheduler sees the failure
RESUMABLE = ("collapse", "distill", "nas")  # the commands with --resume

_run: dict = {"out": None, "signal": None}


def note_output(out: Path) -> None:
    """A resumable command names its output directory once it is decided, for the interrupt message."""
    _run["out"] = Path(out)


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LLMCOMPRESS_DEBUG") == "1"


def _command(argv: list[str]) -> str:
    return next((a for a in argv if not a.startswith("-")), "")


def interrupt_line(argv: list[str]) -> str:
    """One line: which signal, what is kept on disk, and whether `--resume` continues."""
    cmd = _command(argv)
    how = "interrupted (SIGTERM)" if _run["signal"] == signal.SIGTERM else "interrupted"
    if cmd in RESUMABLE:
        out = _run["out"]
        if out is None:
            return f"{how}: {cmd} stopped before writing anything; rerun it to start again"
        return (f"{how}: the steps {cmd} finished are kept in {out}; rerun the same command with --resume "
                f"(same --out {out}) to continue")
    what = {"eval": "its report", "zip": "the zipped checkpoint", "unzip": "the restored files"}.get(cmd)
    if what is None:
        return f"{how}: nothing was written"
    return f"{how}: nothing was kept ({cmd} writes {what} only when it finishes); {cmd} has no --resume: rerun it to start again"


def run_app(app, argv: list[str] | None = None) -> int:
    from llmcompress.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    _run.update(out=None, signal=None)
    previous = _install_handlers()
    try:
        code = app(args=argv, prog_name="llmcompress", standalone_mode=False)
        # typer turns KeyboardInterrupt into Exit(130) and, without standalone mode, returns that code
        if code == INTERRUPTED:
            return _interrupted(argv)
        return code if isinstance(code, int) else 0
    except KeyboardInterrupt:
        return _interrupted(argv)
    except Exception as exc:
        if _run["signal"] is not None:  # an interrupt that library code re-raised as another error
            return _interrupted(argv)  # (transformers' lazy imports turn it into ModuleNotFoundError)
        if isinstance(exc, UserError):
            if _debug(argv):
                raise
            print(f"error: {exc.one_line()}", file=sys.stderr)
            return exc.exit_code
        name = type(exc).__name__  # click usage errors and friends (typer may vendor its own click)
        if name == "Exit" and hasattr(exc, "exit_code"):
            return _interrupted(argv) if exc.exit_code == INTERRUPTED else exc.exit_code
        if name == "Abort":
            return _interrupted(argv)
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
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted(argv: list[str]) -> int:
    print(interrupt_line(argv), file=sys.stderr)
    # CPython quirk: a KeyboardInterrupt that surfaced inside a string exec (dataclasses and namedtuple
    # build their methods that way, so any import can be mid-exec) sets a runtime flag that survives our
    # handling, and `python -m llmcompress` then kills itself with SIGINT at exit (status -2, not 130).
    # Every string exec resets that flag when it starts, so one harmless exec clears it.
    exec("None", {})  # noqa: S102 - a constant string, run only to reset that flag
    return INTERRUPTED


def _unsafe_to_raise(frame) -> bool:
    """Inside an import, a destructor or a weakref finalizer, where an exception is lost or changed."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib._bootstrap") or code.co_name == "__del__" or code.co_filename.endswith("weakref.py"):
            return True
        frame = frame.f_back
    return False


def _on_signal(signum, frame):
    """Ctrl-C or SIGTERM: raise KeyboardInterrupt, so `finally` blocks clean up on the way out. Not inside an
    import or a destructor, though: transformers' lazy modules turn an exception in an import into a
    ModuleNotFoundError, and Python ignores one raised in `__del__` (the run went on to exit 0). There the
    signal is sent again shortly, and acted on once that code is done."""
    _run["signal"] = signum
    if _unsafe_to_raise(frame):
        import threading

        timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    raise KeyboardInterrupt


def _install_handlers() -> dict:
    """Route SIGINT and SIGTERM (kill, a scheduler's time limit) to `_on_signal`; returns the previous
    handlers (none off the main thread; an ignored SIGINT, as in a background job, stays ignored)."""
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
                continue
            previous[signum] = signal.signal(signum, _on_signal)
        except ValueError:  # not the main thread of the main interpreter
            pass
    return previous
