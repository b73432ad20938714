"""`eval --tasks` writes lm-eval's own results JSON (read back with lm-eval's helpers), passes its options through,
shows stderr as ±, and states the perplexity protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_lmeval import write_piqa


def run_eval(*args, data_dir):
    env = {**os.environ, "LLMCOMPRESS_PROGRESS": "0", "LLMCOMPRESS_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "llmcompress", "eval", *map(str, args)], capture_output=True, text=True, env=env, timeout=600)


def test_results_json_in_lm_eval_format(tiny_hf_dir, tmp_path):
    from lm_eval.utils import (
        get_file_task_name,
        get_latest_filename,
        get_results_filenames,
        get_sample_results_filenames,
        make_table,
    )

    write_piqa(tmp_path / "data", n=12)
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 60)
    out = tmp_path / "report"
    r = run_eval(tiny_hf_dir, "--ppl", text, "--seq-len", "64", "--tasks", "piqa", "--limit", "8", "--num-fewshot", "1",
                 "--batch-size", "2", "--log-samples", "--no-speed", "--output-path", out, data_dir=tmp_path / "data")
    assert r.returncode == 0, r.stderr[-3000:]
    files = [str(p) for p in out.rglob("*")]
    results_file = get_latest_filename(get_results_filenames(files))
    res = json.loads(open(results_file).read())
    assert res["n-shot"]["piqa"] == 1 and res["config"]["limit"] == 8 and res["config"]["batch_size"] == 2
    assert res["versions"]["piqa"] == 1.0 and res["configs"]["piqa"]["output_type"] == "multiple_choice"
    acc, se = res["results"]["piqa"]["acc,none"], res["results"]["piqa"]["acc_stderr,none"]
    assert 0 <= acc <= 1 and isinstance(se, float) and se > 0
    table = make_table(res)  # lm-eval's own renderer reads it
    piqa_line = next(line for line in table.splitlines() if "piqa" in line)
    assert "acc" in piqa_line and "±" in piqa_line and float(piqa_line.rsplit("|", 2)[-2]) == round(se, 4)
    samples = get_sample_results_filenames(files)
    assert [get_file_task_name(os.path.basename(f)) for f in samples] == ["piqa"]
    assert len(open(samples[0]).read().splitlines()) == 8
    # our flat report: the same numbers, stderr shown as ±, and the perplexity protocol
    flat = json.loads((out / "report.json").read_text())
    row = flat["models"][0]
    assert row["piqa/acc"] == acc and row["piqa/acc_stderr"] == se and row["piqa/n"] == 8
    assert flat["lm_eval_results"] == [os.path.relpath(results_file, out)]
    md = (out / "report.md").read_text()
    assert f"| piqa/acc | {acc:.4f} ± {se:.4f} |" in md and "piqa/acc_stderr" not in md
    assert "non-overlapping windows of 64 tokens (stride 64), each scored without context" in md
    assert f"{row[f'ppl/{text}/windows']} non-overlapping windows" in flat["ppl_protocol"][str(text)]


def test_lm_eval_option_errors(tiny_hf_dir, tmp_path):
    write_piqa(tmp_path / "data")
    for args, needle in (
        (["--tasks", "piqa", "--log-samples"], "--log-samples needs"),
        (["--tasks", "piqa", "--num-fewshot", "-1", "--out", tmp_path / "o"], "--num-fewshot must be >= 0 and <= 1000000 (got -1)"),
        (["--tasks", "piqa", "--apply-chat-template", "--limit", "2", "--out", tmp_path / "o"], "no chat template"),
    ):
        r = run_eval(tiny_hf_dir, "--ppl", "none", "--seq-len", "64", "--no-speed", *args, data_dir=tmp_path / "data")
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
        assert not (tmp_path / "o").exists()
