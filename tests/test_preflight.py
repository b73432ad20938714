"""Outputs are checked before the work (issue 25, finding 4): an --out that cannot be written, a cache that
cannot be written, or too little free space is exit 2 naming the path, before any model loads.

We run as root in CI containers, where chmod does not stop writes; the unwritable places used here stop
root too: /proc (a pseudo file system) and a path whose parent is a regular file. Free space is faked
by patching shutil.disk_usage.
"""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any command gets as far as loading a model."""
    import llmcompress.io.load as load

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output check")

    monkeypatch.setattr(load, "load_model", refuse)


def run_cli(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, [str(a) for a in args])
    return code, capsys.readouterr().err


def commands(model, data):
    return {
        "eval": ["eval", model, "--ppl", data, "--no-speed"],
        "collapse": ["collapse", model, "--pareto", "--calib-data", data],
        "distill": ["distill", model, "--keep-layers", "2", "--data", data, "--device", "cpu"],
        "nas": ["nas", model, "--target-bits", "4"],
        "zip": ["zip", model],
        "unzip": ["unzip", model],  # the check comes before the archive is read
    }


@pytest.fixture
def setup(tiny_hf_dir, tmp_path, monkeypatch, no_model_loads):
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat. " * 400)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return commands(str(tiny_hf_dir), str(data)), blocker


@pytest.mark.parametrize("cmd", ["eval", "collapse", "distill", "nas", "zip", "unzip"])
def test_unwritable_out_exits_2_naming_it_before_any_model_loads(cmd, setup, capsys):
    cmds, blocker = setup
    for out, reason in [("/proc/llmcompress-out", "not writable"), (blocker / "sub" / "out", "is a file, not a directory")]:
        code, err = run_cli(capsys, *cmds[cmd], "--out", out)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith("error: ") and f"--out {out}" in lines[0] and reason in lines[0], err
    assert not (blocker.parent / "cache" / "tokens").exists()  # nothing computed (no tokenization either)


@pytest.mark.parametrize("cmd", ["eval", "collapse", "distill", "nas", "zip"])
def test_too_little_free_space_exits_2_with_the_estimate(cmd, setup, capsys, monkeypatch, tmp_path):
    cmds, _ = setup
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 1000, 1000))
    out = tmp_path / "out"
    code, err = run_cli(capsys, *cmds[cmd], "--out", out)
    assert code == 2 and "not enough space" in err and "MB free" in err and "needs ~" in err, err
    assert str(out) in err or "cache directory" in err
    assert not out.exists()


def test_free_space_estimate_scales_with_the_model(setup, capsys, monkeypatch, tmp_path, tiny_hf_dir):
    """Enough space for the tiny model's checkpoint passes the check (the run then stops at the model load)."""
    from llmcompress.io.preflight import dir_bytes

    cmds, _ = setup
    size = dir_bytes(tiny_hf_dir)
    usage = namedtuple("usage", "total used free")
    for free, ok in [(size // 2, False), (3 * size + 10**7, True)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: usage(10**12, 0, free))
        code, err = run_cli(capsys, *cmds["nas"], "--out", tmp_path / "o")
        assert ("not enough space" in err) != ok, err
        if ok:  # got past the check: stopped by the no-model-loads guard (exit 1), not by exit 2
            assert code == 1 and "a model was loaded" in err, err


def test_unwritable_cache_exits_2_naming_it(setup, capsys, monkeypatch, tmp_path):
    cmds, _ = setup
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", "/proc/llmcompress-cache")
    for cmd in ("eval", "collapse", "distill", "nas"):
        code, err = run_cli(capsys, *cmds[cmd], "--out", tmp_path / f"o-{cmd}")
        assert code == 2 and "the cache directory (LLMCOMPRESS_CACHE_DIR) /proc/llmcompress-cache is not writable" in err, err
        assert not (tmp_path / f"o-{cmd}").exists()


def test_unwritable_distill_cache_dir(setup, capsys, tmp_path):
    cmds, blocker = setup
    code, err = run_cli(capsys, *cmds["distill"], "--cache-dir", blocker / "feats", "--out", tmp_path / "o")
    assert code == 2 and f"--cache-dir {blocker / 'feats'}" in err, err


def test_unwritable_out_in_a_real_process(tiny_hf_dir, tmp_path):
    """The probe's case (issue 25, finding 4): `eval MODEL --out /proc/foo` computed everything, then exit 1."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, LLMCOMPRESS_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "llmcompress", "eval", str(tiny_hf_dir), "--no-speed", "--out", "/proc/foo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --out /proc/foo is not writable"), proc.stderr
    assert proc.stdout == ""  # no table: nothing was measured
