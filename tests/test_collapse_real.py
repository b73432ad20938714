"""One short integration run on the real smollm2-135m (marked slow)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_tiny_pareto_search_on_smollm2(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmcompress.collapse import CollapseConfig, run_collapse

    cfg = CollapseConfig(
        population=4, generations=1, calib_tokens=512, val_tokens=256, min_layers=27, baselines=["shortgpt"],
        eval_tokens=0, piqa_limit=0, save="knee", tune_steps=4,
    )
    result = run_collapse(cfg, tmp_path / "run", lm=smollm2)
    assert result.front and result.saved
    manifest = json.loads((result.saved[0] / "llmcompress.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(result.saved[0])
    assert model.config.num_hidden_layers == len(manifest["layer_map"]) < 30
    assert sorted(i for e in manifest["layer_map"] for i in e["sources"]) == list(range(30))
    assert smollm2.model.config.num_hidden_layers == 30  # the loaded original is untouched
