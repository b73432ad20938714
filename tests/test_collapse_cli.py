"""`llmcompress collapse` end to end on a tiny model, and bad inputs: one line, exit 2, nothing overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llmcompress", "collapse", *map(str, args)], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)


def _one_line_error(r, needle):
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip() and not s.startswith("notice")]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0]


@pytest.fixture
def tiny_spec(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        f"calib_source: {text}\nseq_len: 32\ncalib_tokens: 128\nval_tokens: 64\npopulation: 4\ngenerations: 1\n"
        "eval_tokens: 0\npiqa_limit: 0\nbaselines: [shortgpt, laco]\nlaco_threshold: 0.0\nmin_layers: 3\nsave: all\n"
    )
    return spec


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target-layers", "1"], "--target-layers must be >= 2"),
        (["--method", "magic", "--pareto"], "'magic' is not one of"),
        (["--population", "0", "--pareto"], "population"),
        (["--generations", "-1", "--pareto"], "generations"),
        (["--ratio", "1.5"], "--ratio"),
        (["--tune-steps", "-1", "--pareto"], "--tune-steps must be >= 0"),
        (["--max-memory", "lots", "--pareto"], "--max-memory 'lots' is not a memory size"),
    ],
)
def test_bad_inputs_fail_fast_with_one_line(tmp_path, args, needle):
    r = cli(*args, "--out", tmp_path / "o")
    _one_line_error(r, needle)
    assert not (tmp_path / "o").exists()


def test_unknown_spec_key(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("population: 4\nmutation_rate_typo: 0.1\n")
    _one_line_error(cli("--spec", spec, "--out", tmp_path / "o"), "mutation_rate_typo")


def test_target_not_below_depth_and_existing_out(tmp_path, tiny_hf_dir):
    _one_line_error(cli(tiny_hf_dir, "--target-layers", "4", "--out", tmp_path / "o"), "out of range")
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _one_line_error(cli(tiny_hf_dir, "--pareto", "--out", out), "already exists")
    assert (out / "keep.txt").read_text() == "mine"


def test_resume_for_another_model_is_refused(tmp_path, tiny_hf_dir, tiny_spec):
    out = tmp_path / "run"
    out.mkdir()
    state = {"format": "llmcompress-collapse-search-1", "model": "someone-else", "fingerprint": "0"}
    (out / "search_state.json").write_text(json.dumps(state))
    before = (out / "search_state.json").read_bytes()
    _one_line_error(cli(tiny_hf_dir, "--spec", tiny_spec, "--resume", "--out", out), "another model or config")
    assert (out / "search_state.json").read_bytes() == before


def test_tiny_pareto_run_writes_everything(tmp_path, tiny_hf_dir, tiny_spec):
    out = tmp_path / "run"
    r = cli(tiny_hf_dir, "--spec", tiny_spec, "--pareto", "--out", out)
    assert r.returncode == 0, r.stderr
    for name in ("pareto.json", "pareto.csv", "pareto.png", "search_log.jsonl", "report.md", "config.json"):
        assert (out / name).is_file(), name
    front = json.loads((out / "pareto.json").read_text())
    assert front["front"] and {b["method"] for b in front["baselines"]} <= {"shortgpt", "laco"}
    log = [json.loads(s) for s in (out / "search_log.jsonl").read_text().splitlines()]
    assert [r["gen"] for r in log] == [0, 1] and "hv_val" in log[-1]
    models = sorted((out / "models").iterdir())
    assert len(models) == len(front["front"])
    walks = json.loads((out / "refine_state.json").read_text())  # every saved count was refined (save: all)
    assert set(walks) == {str(r["layers"]) for r in front["front"]} and all(w["done"] for w in walks.values())
    assert "refined by a walk of swap moves, then swap or merge-coefficient moves" in front["selection"]
    assert "merge coefficients tuned by 48 Adam steps" in front["selection"]
    tunings = json.loads((out / "tune_state.json").read_text())  # then their merge coefficients were tuned
    assert set(tunings) == set(walks) and all(len(t["records"]) == 48 for t in tunings.values())
    from transformers import AutoModelForCausalLM

    manifest = json.loads((models[0] / "llmcompress.json").read_text())
    assert f"llmcompress collapse {tiny_hf_dir} --spec {tiny_spec} --pareto --out {out}" in (models[0] / "README.md").read_text()
    m = AutoModelForCausalLM.from_pretrained(models[0])
    assert m.config.num_hidden_layers == len(manifest["layer_map"]) == manifest["layers"]
    assert sorted(i for e in manifest["layer_map"] for i in e["sources"]) == list(range(4))
    assert manifest["dtype"] == "float32" and manifest["bytes_on_disk"] == (models[0] / "model.safetensors").stat().st_size
    assert "Checkpoints on disk:" in (out / "report.md").read_text()
    # a run killed without cleanup (SIGKILL) leaves spilled states behind; the next run in the dir removes them
    stale = out / "collapse-states-killed"
    stale.mkdir()
    (stale / "b0.pt").write_bytes(b"\0" * 1024)
    r = cli(tiny_hf_dir, "--spec", tiny_spec, "--pareto", "--resume", "--out", out)
    assert r.returncode == 0, r.stderr
    assert not list(out.glob("collapse-states-*"))


def test_sigterm_unwinds_like_ctrl_c():
    """SIGTERM raises KeyboardInterrupt in the command (finally blocks run), exit 130, handler restored."""
    import signal
    import time

    from llmcompress.cli._errors import run_app

    cleaned = []

    def app(args, prog_name, standalone_mode):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    assert run_app(app, []) == 130
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
def test_device_cuda_without_gpu_is_one_line(tmp_path):
    _one_line_error(cli("--target-layers", "3", "--device", "cuda", "--out", tmp_path / "o"), "no CUDA device")
    assert not (tmp_path / "o").exists()
