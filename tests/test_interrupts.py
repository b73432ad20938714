"""Ctrl-C and SIGTERM never exit 0: a real subprocess gets each signal mid-run and must exit 130 with one
line saying what was kept and whether `--resume` continues (issue 25, finding 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler installed for `signum` (Linux /proc: the SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _wait_for(cond, proc, what: str, limit: float = 240.0) -> None:
    """Poll until `cond()` holds (the process got somewhere), failing if it exited first. The limit only
    guards against a hang; the test's outcome never depends on how long anything took."""
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the command exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() - t0 > limit:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", "llmcompress", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def _finish(proc) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=240)
    return proc.returncode, [s for s in err.splitlines() if s.strip()]


@pytest.fixture
def long_text(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(("The quick brown fox jumps over the lazy dog, again and again. " * 200 + "\n\n") * 200)  # ~2.5M tokens
    return path


@pytest.mark.parametrize("signum,delay", [(signal.SIGINT, 0.0), (signal.SIGTERM, 1.0), (signal.SIGINT, 1.0)])
def test_eval_interrupted_exits_130_and_says_nothing_was_kept(tmp_path, tiny_hf_dir, long_text, signum, delay):
    """At once (the command is still importing torch and transformers, where an exception used to become a
    ModuleNotFoundError or be swallowed) or a moment later: the same exit code and line."""
    out = tmp_path / "report"
    proc = _start("eval", tiny_hf_dir, "--ppl", long_text, "--max-tokens", "0", "--seq-len", "64", "--no-speed",
                  "--device", "cpu", "--out", out)
    _wait_for(lambda: _catches(proc.pid, signal.SIGTERM), proc, "its SIGTERM handler was installed")
    time.sleep(delay)  # the outcome must be the same at any point after the handler is installed
    proc.send_signal(signum)
    code, lines = _finish(proc)
    assert code == 130, lines
    assert len(lines) == 1 and lines[0].startswith("interrupted"), lines
    assert "nothing was kept" in lines[0] and "eval has no --resume" in lines[0], lines
    assert ("SIGTERM" in lines[0]) == (signum == signal.SIGTERM)
    assert not out.exists()


def test_collapse_sigterm_mid_search_keeps_state_and_resume_accepts_it(tmp_path, tiny_hf_dir):
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        f"calib_source: {text}\nseq_len: 32\ncalib_tokens: 128\nval_tokens: 64\npopulation: 4\ngenerations: 100000\n"
        "eval_tokens: 0\npiqa_limit: 0\nbaselines: []\nmin_layers: 3\nrefine_steps: 0\ntune_steps: 0\n"
    )
    out = tmp_path / "run"
    proc = _start("collapse", tiny_hf_dir, "--spec", spec, "--pareto", "--out", out)
    log = out / "search_log.jsonl"
    _wait_for(lambda: log.is_file() and len(log.read_text().splitlines()) >= 2, proc, "two generations were logged")
    proc.send_signal(signal.SIGTERM)
    code, lines = _finish(proc)
    assert code == 130, lines
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGTERM)"), lines
    assert f"kept in {out}" in lines[0] and "--resume" in lines[0], lines
    assert not list(out.glob("collapse-states-*"))  # the spilled-state folder was cleaned up on the way out
    gens = [__import__("json").loads(s)["gen"] for s in log.read_text().splitlines()]
    assert gens == list(range(len(gens))) and len(gens) >= 2


def test_interrupt_that_library_code_rewraps_still_exits_130(capsys):
    """transformers' lazy imports turn a KeyboardInterrupt raised inside them into ModuleNotFoundError: the
    signal was received, so the exit is still 130 with the interrupt line (seen under load in this suite)."""
    import typer

    from llmcompress.cli._errors import run_app

    app = typer.Typer()

    @app.command()
    def boom():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt as exc:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from exc

    @app.command()
    def other():
        pass

    before = signal.getsignal(signal.SIGTERM)
    assert run_app(app, ["boom"]) == 130
    err = [s for s in capsys.readouterr().err.splitlines() if s.strip()]
    assert len(err) == 1 and err[0].startswith("interrupted (SIGTERM)"), err
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
