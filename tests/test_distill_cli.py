"""`llmcompress distill` CLI: bad input gives one line and exit 2; torchrun with 2 gloo ranks equals 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import words_text


@pytest.fixture
def data_file(tmp_path):
    """conftest's training text, shorter (2,000 phrases): the figures these tests compare were measured on it."""
    path = tmp_path / "train.txt"
    path.write_text(words_text(2000))
    return path


def _env(tmp_path):
    env = dict(os.environ, LLMCOMPRESS_PROGRESS="0", OMP_NUM_THREADS="1", LLMCOMPRESS_CACHE_DIR=str(tmp_path / "lc"))
    env.pop("LLMCOMPRESS_DEBUG", None)
    return env


def cli(tmp_path, *args, timeout=120):
    cmd = [sys.executable, "-m", "llmcompress", "distill", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=timeout)


def small(teacher, data, tmp_path, *extra):
    return [teacher, "--data", data, "--seq-len", 32, "--batch-size", 4, "--train-tokens", 32 * 4 * 4, "--eval-tokens", 0,
            "--cache-dir", tmp_path / "cache", "--device", "cpu", *extra]


def assert_one_line_error(proc, match):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], proc.stderr[-2000:]


def other_family_student(tmp_path):
    from conftest import tiny_model

    from llmcompress.io.checkpoint import build_manifest, save_checkpoint

    model = tiny_model("gpt2", layers=2)
    manifest = build_manifest(source="x", source_hash="", method="collapse", extra={"layer_map": [{"sources": [0]}, {"sources": [2]}]})
    return save_checkpoint(model, None, tmp_path / "gpt2-student", manifest=manifest)


def in_process(capsys, *args):
    """The same CLI entry point in this process (saves a torch import per case on a shared machine)."""
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, ["distill", *map(str, args)])
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def test_bad_inputs_exit_2_with_one_line(tiny_hf_dir, data_file, tmp_path, capsys, monkeypatch):
    t, d = tiny_hf_dir, data_file
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "f").write_text("x")
    # through a real process: python -m llmcompress distill ...
    assert_one_line_error(cli(tmp_path, *small(t, d, tmp_path, "--keep-layers", 4, "--out", tmp_path / "o1")), "fewer layers than its teacher")
    assert_one_line_error(cli(tmp_path, *small(t, d, tmp_path, "--keep-layers", 2, "--out", tmp_path / "exists")), "already exists")
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "lc"))
    cases = [
        (small(t, d, tmp_path, "--keep-layers", 2, "--segments", 3, "--out", tmp_path / "o2"), "more than the student"),
        (small(t, tmp_path / "missing.txt", tmp_path, "--keep-layers", 2, "--out", tmp_path / "o3"), "missing file"),
        (small(t, d, tmp_path, "--student", other_family_student(tmp_path), "--out", tmp_path / "o4"), "gpt2 model"),
        (small(t, d, tmp_path, "--keep-layers", 2), "--out is required"),
        (small(t, d, tmp_path, "--out", tmp_path / "o5"), "exactly one of --keep-layers"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--ce-weight", -1, "--out", tmp_path / "o6"), "--ce-weight must be >= 0 and <= 1e+06 (got -1.0)"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--epochs", 0, "--out", tmp_path / "o7"), "--epochs must be >= 1 and <= 1000000 (got 0)"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--e2e-lr", 1e-4, "--out", tmp_path / "o8"), "--e2e-lr sets the learning rate of the --e2e-steps phase"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--lr", 0, "--out", tmp_path / "o9"), "--lr must be > 0 and <= 10 (got 0.0)"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--data", f"{d},,{d}", "--out", tmp_path / "o10"), "empty source in --data"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--grad-rank-min", 8, "--grad-rank-max", 4, "--out", tmp_path / "o11"),
         "--grad-rank-min 8 is above --grad-rank-max 4"),
        (small(t, d, tmp_path, "--keep-layers", 2, "--grad-compress", "edgc", "--out", tmp_path / "o12"),
         "--grad-compress applies to data-parallel end-to-end training"),
    ]
    for args, match in cases:
        assert_one_line_error(in_process(capsys, *args), match)


def _student_tensors(out):
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "student").glob("*.safetensors")):  # one file, or one shard per layer (streamed)
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.dist
@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
def test_torchrun_two_gloo_ranks_equal_single_process(streamed, tiny_hf_dir, data_file, tmp_path):
    """Phase-1 segments spread over 2 ranks give the single-process student; also with the teacher streamed
    layer by layer on every rank (--max-memory 0), to float rounding."""

    from llmcompress.distill import DistillConfig
    from llmcompress.distill.engine import distill

    args = small(tiny_hf_dir, data_file, tmp_path, "--keep-layers", 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the single-process reference runs here (same settings as the CLI flags below)
        cfg = DistillConfig(teacher=str(tiny_hf_dir), keep_layers=3, data=str(data_file), seq_len=32, batch_size=4,
                            train_tokens=32 * 4 * 4, eval_tokens=0, cache_dir=str(tmp_path / "cache"))
        distill(cfg, tmp_path / "one")
    finally:
        torch.set_num_threads(threads)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "llmcompress", "distill",
           *map(str, args), "--out", str(tmp_path / "two"), *(["--max-memory", "0"] if streamed else [])]
    two = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=150)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _student_tensors(tmp_path / "one"), _student_tensors(tmp_path / "two")
    assert a.keys() == b.keys() and len(list((tmp_path / "two" / "student").glob("*.safetensors"))) == (3 + 1 if streamed else 1)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4 if streamed else 1e-5, atol=1e-5 if streamed else 1e-6)
    log = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert {r["segment"] for r in log if r["phase"] == 1} == {0, 1, 2}
