"""eval.report.measure_noted, the engines' post-run evaluation: missing data or a missing lm-eval becomes a note
naming what was not measured and how to fix it, the other measures still run; a bug raises."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lm(tiny_hf_dir, tmp_path, monkeypatch):
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(tmp_path / "no-data"))  # nothing here, and the hub is off
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    return load_model(str(tiny_hf_dir))


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


def test_missing_dataset_is_a_note_naming_it_and_the_fix(lm, text, capsys):
    from llmcompress.eval.report import NOTES, EvalSpec, measure, measure_noted, ppl_key

    spec = EvalSpec(ppl=["wikitext2", str(text)], seq_len=32, max_tokens=256, speed=False)
    row = measure_noted(lm.model, lm.tokenizer, spec)
    assert ppl_key("wikitext2") not in row
    (note,) = row[NOTES]
    assert "perplexity on wikitext2 (ppl/wikitext2) not measured" in note
    assert "'wikitext2'" in note and "llmcompress data fetch wikitext2" in note and "LLMCOMPRESS_DATA_DIR" in note
    assert "notice: " + note in capsys.readouterr().err
    # the corpus that is here is still measured, with the value `measure` gives
    alone = measure(lm.model, lm.tokenizer, EvalSpec(ppl=[str(text)], seq_len=32, max_tokens=256, speed=False))
    assert row[ppl_key(str(text))] == alone[ppl_key(str(text))] > 1


def test_missing_lm_eval_is_a_note(lm, monkeypatch):
    from llmcompress.eval.report import NOTES, EvalSpec, measure_noted

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ModuleNotFoundError
    row = measure_noted(lm.model, lm.tokenizer, EvalSpec(ppl=[], tasks=["piqa"], limit=2, speed=False))
    (note,) = row[NOTES]
    assert note.startswith("lm-eval piqa not measured") and "pip install lm-eval" in note


def test_a_bug_raises(lm, text, monkeypatch):
    from llmcompress.eval.report import EvalSpec, measure_noted

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the model")

    monkeypatch.setattr(lm.model, "forward", broken)
    with pytest.raises(RuntimeError, match="a bug in the model"):
        measure_noted(lm.model, lm.tokenizer, EvalSpec(ppl=[str(text)], seq_len=32, max_tokens=256, speed=False))


def test_a_bad_setting_is_not_a_note(lm, text):
    """Only unavailable data or packages become notes: a --seq-len beyond the model's context stays an error."""
    from llmcompress.errors import UserError
    from llmcompress.eval.report import EvalSpec, measure_noted

    with pytest.raises(UserError, match="beyond the model's context"):
        measure_noted(lm.model, lm.tokenizer, EvalSpec(ppl=[str(text)], seq_len=4096, max_tokens=8192, speed=False))


def test_collapse_quality_notes_missing_data_and_raises_on_a_bug(lm, monkeypatch):
    from llmcompress.collapse.export import quality

    q = quality(lm.model, lm.tokenizer, eval_tokens=96, seq_len=32, piqa_limit=0)
    assert "ppl/wikitext2" not in q and len(q["notes"]) == 1 and "llmcompress data fetch wikitext2" in q["notes"][0]

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the model")

    monkeypatch.setattr(lm.model, "forward", broken)
    import torch

    blocks = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="a bug in the model"):
        quality(lm.model, lm.tokenizer, eval_tokens=32, seq_len=16, piqa_limit=0, ppl_blocks=blocks)


def test_nas_evaluate_notes_missing_data(lm):
    import dataclasses

    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.pipeline import evaluate

    cfg = dataclasses.replace(NasConfig(), eval_tokens=64, eval_seq_len=32, measure_speed=False)
    row = evaluate(lm.model, lm.tokenizer, cfg)
    assert "ppl/wikitext2" not in row and "llmcompress data fetch wikitext2" in row["notes"][0]
