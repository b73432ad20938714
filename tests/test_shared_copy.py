"""Derived models share the tensors they do not change (issue 20: no second full copy of the model)."""

from __future__ import annotations

import copy

import torch
from conftest import tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_collapse_build_model_shares_kept_tensors_and_leaves_the_source_intact():
    from llmcompress.collapse.export import build_model
    from llmcompress.collapse.operator import collapse_group
    from llmcompress.collapse.space import Candidate
    from llmcompress.io.adapters import get_adapter
    from llmcompress.io.surgery import replace_layers

    model = tiny_model("llama", layers=6)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    from llmcompress.collapse.config import KINDS

    one = tuple(1.0 for _ in KINDS)
    cand = Candidate(((0,), (1, 2), (3,), (5,)), ((), (one,), (), ()))
    new = build_model(model, cand)
    # reference: the former way, a deep copy of the whole model
    ref = copy.deepcopy(model)
    layers = list(get_adapter(ref).decoder_layers(ref))
    replace_layers(ref, [collapse_group([layers[i] for i in g], cand.alpha_dicts(k), get_adapter(ref).kind_of)
                         for k, g in enumerate(cand.groups)], [g[0] for g in cand.groups])
    torch.testing.assert_close(_logits(new, ids), _logits(ref, ids), rtol=0, atol=0)
    src_layers, new_layers = get_adapter(model).decoder_layers(model), get_adapter(new).decoder_layers(new)
    assert new.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert new_layers[2].mlp.down_proj.weight.data_ptr() == src_layers[3].mlp.down_proj.weight.data_ptr()
    assert new_layers[1].mlp.down_proj.weight.data_ptr() != src_layers[1].mlp.down_proj.weight.data_ptr()  # merged: new
    shared = {p.data_ptr() for p in model.parameters()}
    new_bytes = sum(p.numel() * p.element_size() for p in new.parameters() if p.data_ptr() not in shared)
    layer_bytes = sum(p.numel() * p.element_size() for p in src_layers[1].parameters())
    assert new_bytes == layer_bytes  # only the merged layer is new memory
    # the source keeps its 6 layers, its config and its outputs
    assert model.config.num_hidden_layers == 6 and len(src_layers) == 6
    assert [m.self_attn.layer_idx for m in src_layers] == list(range(6))
    torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)


def test_nas_zero_padded_shares_all_but_the_padded_mlps():
    from llmcompress.nas.export import slice_mlp_, zero_padded

    model = tiny_model("llama", layers=3)
    slice_mlp_(model.model.layers[1], 64)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    padded = zero_padded(model, 128)
    torch.testing.assert_close(_logits(padded, ids), before, rtol=1e-6, atol=1e-6)
    assert padded.model.layers[1].mlp.down_proj.in_features == 128 and model.model.layers[1].mlp.down_proj.in_features == 64
    assert padded.model.layers[1].self_attn.q_proj.weight.data_ptr() == model.model.layers[1].self_attn.q_proj.weight.data_ptr()
    assert padded.model.layers[0].mlp.up_proj.weight.data_ptr() == model.model.layers[0].mlp.up_proj.weight.data_ptr()
    torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)
