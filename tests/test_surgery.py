"""Layer surgery keeps models correct: logits, KV cache, generate(), reload with plain transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.io.adapters import get_adapter
from llmcompress.io.forward import boundary_states, run_layers
from llmcompress.io.surgery import keep_layers, kept_copy, remove_layers, swapped_layers

IDS = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_keep_all_layers_changes_nothing(family):
    model = tiny_model(family)
    before = logits(model)
    keep_layers(model, list(range(model.config.num_hidden_layers)))
    assert torch.equal(logits(model), before)


def test_removal_updates_config_and_layer_idx(family):
    model = tiny_model(family, layers=5)
    types_before = list(getattr(model.config, "layer_types", []) or [])
    remove_layers(model, [1, 3])
    layers = get_adapter(model).decoder_layers(model)
    assert model.config.num_hidden_layers == len(layers) == 3
    idx = [m.layer_idx for layer in layers for m in layer.modules() if hasattr(m, "layer_idx")]
    assert sorted(set(idx)) == [0, 1, 2]
    if types_before:
        assert model.config.layer_types == [types_before[i] for i in (0, 2, 4)]


def test_generate_with_cache_equals_without_after_removal(family):
    model = tiny_model(family, layers=5)
    remove_layers(model, [0, 2])
    prompt = IDS[:1, :8]
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, **kw)
    without = model.generate(prompt, use_cache=False, **kw)
    assert with_cache.shape[1] == 20
    assert torch.equal(with_cache, without)


def test_removal_equals_fresh_model_with_those_layers(family):
    """Dropping layers gives the same logits as building the smaller model and copying the kept weights."""
    model = tiny_model(family, layers=4)
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 2
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in (1, 3)]
    fresh = type(model)(cfg).eval()
    adapter = get_adapter(model)
    src = adapter.decoder_layers(model)
    sd = {k: v for k, v in model.state_dict().items() if f"{adapter.layers}." not in k}
    for new, old in enumerate((1, 3)):
        for k, v in src[old].state_dict().items():
            sd[f"{adapter.layers}.{new}.{k}"] = v
    fresh.load_state_dict(sd)
    remove_layers(model, [0, 2])
    torch.testing.assert_close(logits(model), logits(fresh), rtol=0, atol=0)


def test_kept_copy_equals_keep_layers_on_a_copy_and_never_copies_a_dropped_layer(family, monkeypatch):
    """`kept_copy` (students and derived nas models) is `keep_layers(copy.deepcopy(model), keep)` without the
    transient whole copy: the dropped layers are never deep-copied, the original is unchanged, and the copy's
    logits, config, layer_idx and cached generation are those of the in-place removal."""
    model = tiny_model(family, layers=5)
    before, config_before = logits(model), model.config.to_dict()
    ref = keep_layers(copy.deepcopy(model), [0, 2, 4])
    layers = get_adapter(model).decoder_layers(model)

    def refuse(self, memo):
        raise AssertionError("a dropped layer was copied")

    for i in (1, 3):
        monkeypatch.setattr(layers[i], "__deepcopy__", refuse.__get__(layers[i]), raising=False)
    new = kept_copy(model, [0, 2, 4])
    assert torch.equal(logits(model), before) and model.config.to_dict() == config_before  # the original is untouched
    assert len(get_adapter(model).decoder_layers(model)) == 5
    assert new.config.to_dict() == ref.config.to_dict() and new.config.num_hidden_layers == 3
    idx = [m.layer_idx for layer in get_adapter(new).decoder_layers(new) for m in layer.modules() if hasattr(m, "layer_idx")]
    assert idx == [m.layer_idx for layer in get_adapter(ref).decoder_layers(ref) for m in layer.modules() if hasattr(m, "layer_idx")]
    torch.testing.assert_close(logits(new), logits(ref), rtol=0, atol=0)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(new.parameters(), model.parameters()))  # a real copy
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(new.generate(IDS[:1, :6], use_cache=True, **kw), new.generate(IDS[:1, :6], use_cache=False, **kw))


def test_saved_model_reloads_with_plain_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(family, layers=4)
    remove_layers(model, [2])
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert again.config.num_hidden_layers == 3
    assert torch.equal(logits(again), logits(model))


def test_swapped_layers_restores_everything(family):
    model = tiny_model(family, layers=4)
    before = logits(model)
    layers = list(get_adapter(model).decoder_layers(model))
    with swapped_layers(model, [layers[3], layers[0]], [3, 0]):
        assert model.config.num_hidden_layers == 2
        assert not torch.equal(logits(model), before)
    assert model.config.num_hidden_layers == 4
    assert torch.equal(logits(model), before)
    idx = [m.layer_idx for layer in layers for m in layer.modules() if hasattr(m, "layer_idx")]
    assert idx == sorted(idx)


def test_run_from_cached_boundary_matches_full_forward(family):
    """Running the suffix from a cached boundary state equals the full model (the collapse prefix cache)."""
    model = tiny_model(family, layers=4)
    states, full = boundary_states(model, IDS)
    assert len(states) == 5
    layers = list(get_adapter(model).decoder_layers(model))
    with torch.no_grad():
        for start in (0, 2, 3):
            out = run_layers(model, states[start], layers[start:], list(range(start, 4)))
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
        h = run_layers(model, states[1], layers[1:3], [1, 2], output="hidden")
    torch.testing.assert_close(h, states[3], rtol=1e-5, atol=1e-5)


def test_out_of_range_indices_are_user_errors():
    from llmcompress.errors import UserError

    model = tiny_model("llama")
    with pytest.raises(UserError, match="out of range"):
        remove_layers(model, [7])
    with pytest.raises(UserError, match="at least one"):
        keep_layers(model, [])
