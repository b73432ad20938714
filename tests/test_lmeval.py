"""lm-eval on the shipped local PIQA task, offline, on an in-memory model."""

from __future__ import annotations

import pytest

from llmcompress.eval.lmeval import run_lm_eval, shipped_tasks


def test_piqa_is_shipped():
    assert "piqa" in shipped_tasks()


def write_piqa(data_dir, n=8):
    """A PIQA-format validation file made by the test (the task reads goal/sol1/sol2/label), so no corpus is needed."""
    import json

    (data_dir / "piqa").mkdir(parents=True)
    recs = [{"goal": f"How do I open jar {i}?", "sol1": "Twist the lid.", "sol2": "Paint the lid.", "label": i % 2} for i in range(n)]
    (data_dir / "piqa" / "piqa_validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_local_piqa_runs_offline_on_tiny_model(tiny_hf_dir, monkeypatch, tmp_path):
    write_piqa(tmp_path / "data")
    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from llmcompress.io.load import load_model

    lm = load_model(str(tiny_hf_dir))
    res = run_lm_eval(lm.model, lm.tokenizer, ["piqa"], limit=8, batch_size=4)
    assert res["piqa"]["n"] == 8
    assert 0.0 <= res["piqa"]["acc"] <= 1.0 and res["piqa"]["acc"] * 8 == round(res["piqa"]["acc"] * 8)


def test_missing_local_data_is_a_user_error(tiny_hf_dir, monkeypatch, tmp_path):
    from llmcompress.errors import DataError
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(tmp_path))
    lm = load_model(str(tiny_hf_dir))
    with pytest.raises(DataError, match="piqa_validation.jsonl"):
        run_lm_eval(lm.model, lm.tokenizer, ["piqa"], limit=2)


def test_include_path_task(tiny_hf_dir, tmp_path):
    """A user task YAML from --include-tasks runs through lm-eval's include_path."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"q": "Is {i} even?", "a": "{"yes" if i % 2 == 0 else "no"}", "label": {i % 2}}}\n' for i in range(6)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "parity.yaml").write_text(
        "task: parity_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    validation: {data}\noutput_type: multiple_choice\nvalidation_split: validation\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: label\ndoc_to_choice: ["yes", "no"]\n'
        "metric_list:\n  - metric: acc\n"
    )
    from llmcompress.io.load import load_model

    lm = load_model(str(tiny_hf_dir))
    res = run_lm_eval(lm.model, lm.tokenizer, ["parity_local"], include_path=tasks)
    assert res["parity_local"]["n"] == 6
