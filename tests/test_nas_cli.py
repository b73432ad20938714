"""`llmcompress nas` on the command line: bad input is one line and exit 2; a tiny end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0", "OMP_NUM_THREADS": "1"}


def nas(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "llmcompress", "nas", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def _one_line_error(r, needle):
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_help():
    r = nas("--help")
    assert r.returncode == 0 and "--target-latency" in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target-bits", "4", "--bits", "1,4"], "--bits must be >= 2 and <= 16 (got 1)"),
        (["--target-bits", "4", "--group-size", "48"], "does not divide"),
        (["--target-latency", "0.01"], "--target-latency 0.01 is below"),
    ],
)
def test_bad_inputs_exit_2_one_line(tiny_hf_dir, tmp_path, args, needle):
    _one_line_error(nas(tiny_hf_dir, *args, "--out", tmp_path / "o"), needle)


def test_existing_out_and_bad_spec(tiny_hf_dir, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("x")
    _one_line_error(nas(tiny_hf_dir, "--target-bits", "4", "--out", tmp_path / "o"), "already exists")
    spec = tmp_path / "s.yaml"
    spec.write_text("target_bits: 4\nfoo: 1\n")
    _one_line_error(nas(tiny_hf_dir, "--spec", spec, "--out", tmp_path / "p"), "unknown search-spec key(s): foo")
    spec.write_text("target_bits: 4\nbits_init: knapsack\n")
    _one_line_error(nas(tiny_hf_dir, "--spec", spec, "--out", tmp_path / "q"), "unknown bits_init 'knapsack'")
    assert not (tmp_path / "q").exists()


@pytest.mark.requires_data("wikitext2")
def test_tiny_end_to_end(tiny_hf_dir, tmp_path):
    from llmcompress.io.load import load_model
    spec = tmp_path / "s.yaml"
    spec.write_text("seq_len: 32\nbatch_size: 2\ncontext_len: 32\neval_seq_len: 64\ncheckpoint_every: 1\nrefine_evals: 6\nrefine_blocks: 4\nsearch_steps: 2\n")
    out = tmp_path / "run"
    r = nas(tiny_hf_dir, "--spec", spec, "--target-latency", "0.7", "--target-bits", "4", "--train-tokens", "128",
            "--eval-tokens", "256", "--baselines", "uniform", "--export", "compressed-tensors", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    arch = json.loads((out / "arch.json").read_text())
    assert arch["avg_bits"] <= 4.0 + 1e-9 and arch["modeled_latency"] <= 0.7 + 1e-9 and arch["size_mb"] > 0
    log = [json.loads(line) for line in (out / "search_log.jsonl").read_text().splitlines()]
    assert sum(r["stage"] == "joint" for r in log) == 2
    refine = arch["refine"]  # the validated last step: measured KL of the starts, then mutations
    assert {"searched", "uniform"} <= set(refine["start_kl"])
    assert sum(r["stage"] == "refine" and "step" in r for r in log) == refine["evaluated"] > 0
    # what was searched is what was shipped: the exported hf/ model's KL to the teacher on the validated
    # step's held-out blocks is the KL that step measured for the plan it chose (GPTQ weights in both)
    from llmcompress.nas.config import config_from_dict, load_spec
    from llmcompress.nas.pipeline import search_blocks
    from llmcompress.nas.sensitivity import mean_kl, reference_logp

    cfg = config_from_dict({"target_latency": 0.7, "target_bits": 4.0, "train_tokens": 128}, load_spec(spec))
    teacher = load_model(str(tiny_hf_dir))
    _, held_out = search_blocks(teacher.tokenizer, cfg)
    hf = load_model(str(out / "hf"))
    shipped_kl = mean_kl(hf.model, held_out, reference_logp(teacher.model, held_out))
    assert shipped_kl == pytest.approx(refine["final_kl"], rel=1e-3)
    report = (out / "report.md").read_text()
    assert "uniform" in arch["baselines"] and all(f"| {r} |" in report for r in ("joint (GPTQ)", "uniform (GPTQ)"))
    assert arch["quant_method"] == "gptq" and arch["baselines"]["uniform"]["quant_method"] == "gptq"
    assert hf.manifest["method"] == "nas-joint/gptq"
    assert hf.source_dtype == "float32" and hf.manifest["dtype"] == "float32"  # the tiny source is float32
    ct = json.loads((out / "compressed-tensors" / "config.json").read_text())
    assert ct["num_hidden_layers"] == arch["architecture"]["kept"] and ct["quantization_config"]["format"] == "pack-quantized"
    assert arch["exports"]["compressed-tensors"]["bytes"] == (out / "compressed-tensors" / "model.safetensors").stat().st_size
    assert not (out / "packed").exists()
    # resume of a finished run redoes nothing in the search and rewrites the same architecture
    r2 = nas(tiny_hf_dir, "--spec", spec, "--target-latency", "0.7", "--target-bits", "4", "--train-tokens", "128",
             "--eval-tokens", "0", "--baselines", "", "--out", out, "--resume")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert json.loads((out / "arch.json").read_text())["architecture"] == arch["architecture"]
    assert len((out / "search_log.jsonl").read_text().splitlines()) == len(log)
