"""collapse quality measures without an evaluation corpus: held-out self text gives every report row a perplexity
(said once at the start, with how to get WikiText-2); with WikiText-2 present, its perplexity is used as before."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def run_tiny(tiny_hf_dir, tmp_path, monkeypatch, data_dir):
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.collapse.pipeline import run_collapse
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(data_dir))
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    cfg = CollapseConfig(
        model=str(tiny_hf_dir), calib_source=str(text), seq_len=32, calib_tokens=128, val_tokens=64, population=4,
        generations=1, refine_steps=0, tune_steps=0, baselines=["shortgpt", "laco"], laco_threshold=0.0, min_layers=3,
        eval_tokens=96, eval_seq_len=32, piqa_limit=4, save="knee",
    )
    run_collapse(cfg, tmp_path / "run", lm=load_model(str(tiny_hf_dir)))
    out = tmp_path / "run"
    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    return report, rows, json.loads((out / "pareto.json").read_text())


def ppl_cells(rows):
    return [row.split("|")[6].strip() for row in rows]


def test_no_corpus_measures_held_out_self_text(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    report, rows, front = run_tiny(tiny_hf_dir, tmp_path, monkeypatch, tmp_path / "no-data")
    err = capsys.readouterr().err
    assert err.count("notice: WikiText-2 is not here") == 1 and "llmcompress data fetch wikitext2" in err
    assert "| held-out self-text ppl |" in report
    assert "held-out self text: 3 sequences of 32 tokens sampled from the dense model" in report
    assert "disjoint from the calibration and validation text" in report
    assert len(rows) >= 3 and all(re.fullmatch(r"\d+\.\d\d", c) for c in ppl_cells(rows)), rows
    assert "PIQA: not measured (dataset missing" in report and "DataError" not in report
    chosen = [r for r in front["front"] if "checkpoint" in r]
    assert chosen and all(r["ppl/self"] > 1 for r in chosen + front["baselines"])
    assert all("ppl/wikitext2" not in r for r in front["baselines"])


def test_with_wikitext_its_perplexity_is_used(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "wikitext-2" / "wiki.test.raw").write_text(" = Valkyria = \n The game began development in 2010 . \n" * 20)
    report, rows, front = run_tiny(tiny_hf_dir, tmp_path, monkeypatch, data)
    assert "notice: WikiText-2" not in capsys.readouterr().err
    assert "| WikiText-2 ppl |" in report and "held-out self" not in report
    assert "WikiText-2 raw test, first 96 tokens, non-overlapping windows of 32 tokens (stride 32)" in report
    chosen = [r for r in front["front"] if "checkpoint" in r]
    assert chosen and all(r["ppl/wikitext2"] > 1 and "ppl/self" not in r for r in chosen)


def test_self_validation_blocks_are_other_samples_than_calibration(tiny_hf_dir, tmp_path, monkeypatch):
    """`self` text at an offset (validation) is sampled with its own seed, not a copy of the first calibration blocks."""
    from llmcompress.collapse.export import held_out_self_blocks
    from llmcompress.data.blocks import calibration_blocks
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    lm = load_model(str(tiny_hf_dir))
    calib, _ = calibration_blocks(lm.tokenizer, "self", seq_len=16, n_blocks=3, seed=1, model=lm.model)
    val, _ = calibration_blocks(lm.tokenizer, "self", seq_len=16, n_blocks=3, seed=1, offset=3, model=lm.model)
    held = held_out_self_blocks(lm.model, lm.tokenizer, eval_tokens=48, seq_len=16, seed=1)
    rows = {tuple(r.tolist()) for r in torch.cat([calib, val, held])}
    assert len(rows) == 9  # nine distinct sequences: no block is shared between the three sets
