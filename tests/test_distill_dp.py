"""Data-parallel e2e distillation under torchrun (2 gloo ranks): DDP with `--grad-compress`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_distill_cli import _env, data_file, small  # noqa: F401  (data_file is a fixture)

pytestmark = pytest.mark.dist


def _torchrun(tmp_path, args, out, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "llmcompress",
           "distill", *map(str, args), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "student" / "model.safetensors"))


def test_ddp_e2e_equals_single_process_and_zip_is_bit_identical(tiny_hf_dir, data_file, tmp_path):  # noqa: F811
    from llmcompress.distill import DistillConfig
    from llmcompress.distill.engine import distill

    steps = 4
    args = small(tiny_hf_dir, data_file, tmp_path, "--keep-layers", 3, "--mode", "e2e", "--threads", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the single-process reference, same global batch of 4 blocks per step
        cfg = DistillConfig(teacher=str(tiny_hf_dir), keep_layers=3, mode="e2e", data=str(data_file), seq_len=32, batch_size=4,
                            train_tokens=32 * 4 * steps, eval_tokens=0, cache_dir=str(tmp_path / "cache"))
        distill(cfg, tmp_path / "one")
    finally:
        torch.set_num_threads(threads)
    _torchrun(tmp_path, args, tmp_path / "none")
    _torchrun(tmp_path, [*args, "--grad-compress", "zip"], tmp_path / "zip")
    one, none, zipped = _weights(tmp_path / "one"), _weights(tmp_path / "none"), _weights(tmp_path / "zip")
    changed = 0
    for k in one:
        # 2 ranks x 2 blocks vs 1 x 4: the averaged gradient differs only in summation order; Adam's first steps
        # are close to lr x sign(g), so the tolerance is a small fraction of lr (5e-4) x steps
        torch.testing.assert_close(none[k], one[k], rtol=0, atol=2e-4)
        assert torch.equal(zipped[k], none[k])  # lossless exchange: the same bits as plain all-reduce
        changed += int(not torch.equal(none[k], _weights_before(tiny_hf_dir, k)))
    assert changed > 0  # it trained
    log_one = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    log_two = [json.loads(x) for x in (tmp_path / "none" / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log_two] == pytest.approx([r["loss"] for r in log_one], rel=1e-4)  # the global batch's loss
    rep_none = json.loads((tmp_path / "none" / "report.json").read_text())
    rep_zip = json.loads((tmp_path / "zip" / "report.json").read_text())
    n_train = sum(v.numel() for k, v in one.items() if ".layers." in k)  # the decoder layers train, fp32
    assert rep_none["comm_bytes"] == steps * 4 * n_train  # 2 ranks: a ring all-reduce sends the payload once
    assert 0 < rep_zip["comm_bytes"] < rep_none["comm_bytes"]
    assert rep_none["final_train_loss"] == pytest.approx(log_one[-1]["loss"], rel=1e-4)  # last 10% of 4 steps = the last


def _weights_before(tiny_hf_dir, key):
    from safetensors.torch import load_file

    w = load_file(str(tiny_hf_dir / "model.safetensors"))
    return w.get(key, torch.empty(0))


def test_e2e_steps_phase_with_edgc_and_resume(tiny_hf_dir, data_file, tmp_path):  # noqa: F811
    """Layer-wise phases, then 8 data-parallel e2e steps through EDGC (2 dense, then compressed at rank <= 4);
    a rerun with --resume from the step-6 checkpoint ends with the same student and byte count."""
    args = small(tiny_hf_dir, data_file, tmp_path, "--keep-layers", 3, "--e2e-steps", 8, "--threads", 1, "--grad-compress", "edgc",
                 "--grad-warmup", 2, "--grad-rank-min", 1, "--grad-rank-max", 4, "--keep-work")
    out = tmp_path / "edgc"
    _torchrun(tmp_path, args, out)
    rep = json.loads((out / "report.json").read_text())
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    e2e = [r for r in log if r["phase"] == "e2e"]
    assert [r["step"] for r in e2e] == list(range(8))
    assert [r["grad_rank"] for r in e2e[:2]] == [None, None] and all(1 <= r["grad_rank"] <= 4 for r in e2e[2:])
    dense = e2e[0]["comm_bytes"]
    assert all(r["comm_bytes"] == dense for r in e2e[:2]) and all(r["comm_bytes"] < dense / 2 for r in e2e[2:])
    assert rep["comm_bytes"] == sum(r["comm_bytes"] for r in e2e)
    assert rep["final_train_loss"] == pytest.approx(e2e[-1]["loss"])
    assert (out / "grad-compress.png").stat().st_size > 1000
    first = _weights(out)
    # an interruption after step 6: the e2e result and the student are gone, the step-6 checkpoint is there
    state = json.loads((out / "work" / "state.json").read_text())
    state["e2e_done"] = False
    (out / "work" / "state.json").write_text(json.dumps(state))
    for f in (out / "work").glob("e2e.*"):  # e2e.json + e2e.safetensors (io/rundir.py state)
        f.unlink()
    import shutil

    shutil.rmtree(out / "student")
    _torchrun(tmp_path, [*args, "--resume"], out)
    again = _weights(out)
    for k in first:
        torch.testing.assert_close(again[k], first[k], rtol=0, atol=1e-6)
    log2 = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()][len(log):]
    e2e2 = [r for r in log2 if r["phase"] == "e2e"]
    assert [r["step"] for r in e2e2] == [6, 7]  # continued, with the same rank schedule and bytes
    assert [(r["grad_rank"], r["comm_bytes"]) for r in e2e2] == [(r["grad_rank"], r["comm_bytes"]) for r in e2e[6:]]
    assert json.loads((out / "report.json").read_text())["comm_bytes"] == rep["comm_bytes"]
