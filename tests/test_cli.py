"""The command line: fast help, one-line errors with exit code 2, nothing written on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llmcompress", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_help_lists_commands_and_is_fast():
    t0 = time.perf_counter()
    proc = run("--help")
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0
    for cmd in ("eval", "info", "collapse", "distill", "nas", "zip"):
        assert cmd in proc.stdout
    # the budget is 1.5 s; importing torch alone takes longer, so this proves no heavy import happens
    code = "import sys, llmcompress.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.split() == ["False", "False"], out
    print(f"--help took {elapsed:.2f}s")


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["info", "/no/such/model"], ["not found"]),
        (["eval", "/no/such/model", "--no-speed"], ["not found"]),
        (["eval", "{tiny}", "--ppl", "no-such-set", "--no-speed"], ["unknown dataset"]),
        (["eval", "{tiny}", "--ppl", "{empty}", "--no-speed"], ["empty"]),
        (["eval", "{tiny}", "--ppl", "{short}", "--no-speed", "--seq-len", "64"], ["shorter than one block"]),
        (["eval", "{tiny}", "--seq-len", "100000", "--ppl", "{short}", "--no-speed"], ["beyond the model's context"]),
        (["eval", "{tiny}", "--out", "{existing}", "--no-speed"], ["already exists", "--overwrite"]),
        (["info", "{notmodel}"], ["not a model directory"]),
        (["info", "{bert}"], ["unsupported architecture", "llama"]),
        (["info", "{corrupt}"], ["corrupt checkpoint"]),
    ],
)
def test_bad_input_exits_2_with_one_line(args, fragments, tiny_hf_dir, tmp_path):
    import shutil

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "report.md").write_text("precious")
    notmodel = tmp_path / "notmodel"
    notmodel.mkdir()
    bert = tmp_path / "bert"
    shutil.copytree(tiny_hf_dir, bert)
    cfg = json.loads((bert / "config.json").read_text())
    cfg["model_type"] = "bert"
    (bert / "config.json").write_text(json.dumps(cfg))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_hf_dir, corrupt)
    st = corrupt / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    subs = dict(tiny=tiny_hf_dir, empty=empty, short=short, existing=existing, notmodel=notmodel, bert=bert, corrupt=corrupt)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = run(*[a.format(**subs) for a in args], cwd=tmp_path)
    assert_user_error(proc, *fragments)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    assert (existing / "report.md").read_text() == "precious"


def test_debug_shows_traceback():
    proc = run("--debug", "info", "/no/such/model")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_info_and_eval_on_a_tiny_checkpoint(tiny_hf_dir, tmp_path):
    proc = run("info", str(tiny_hf_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["layers"] == 4 and info["family"] == "llama" and info["kv_heads"] == 2

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "report"
    proc = run("eval", str(tiny_hf_dir), str(tiny_hf_dir), "--ppl", str(text), "--seq-len", "64", "--json", "--out", str(out), "--no-speed")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    a, b = summary["models"]
    key = f"ppl/{text}"
    assert a[key] == b[key] and 1.0 < a[key] < 1e6
    assert a[f"{key}/tokens_scored"] == (len(text.read_text()) // 64) * 63
    assert (out / "report.md").read_text().count("|") > 10
    assert json.loads((out / "report.json").read_text())["models"][0][key] == a[key]


@pytest.mark.parametrize("cmd", ["nas", "zip"])
def test_engine_without_required_input_exits_2(cmd):
    assert_user_error(run(cmd), "error")
