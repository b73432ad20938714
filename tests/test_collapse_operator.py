"""Collapse operator invariants on tiny models: group of one, alpha = 0 is dropping, alpha = 1 is LaCo's merge."""

from __future__ import annotations

import copy

import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.collapse.baselines import merge_groups
from llmcompress.collapse.export import build_model
from llmcompress.collapse.fitness import topk_kl
from llmcompress.collapse.operator import collapse_group, merge_tensors, uniform_alphas
from llmcompress.collapse.space import Candidate
from llmcompress.io.adapters import get_adapter
from llmcompress.io.surgery import remove_layers

IDS = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def test_merge_tensors_formula():
    a, b, c = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    out = merge_tensors(a, [b, c], [0.5, 1.0])
    assert torch.allclose(out, a + 0.5 * (b - a) + (c - a))
    assert torch.equal(merge_tensors(a, [b], [0.0]), a)


def test_group_of_one_changes_nothing(family):
    model = tiny_model(family, layers=4)
    before = logits(model)
    ident = Candidate(tuple((i,) for i in range(4)), tuple(() for _ in range(4)))
    assert torch.equal(logits(build_model(model, ident)), before)
    layer = get_adapter(model).decoder_layers(model)[1]
    assert collapse_group([layer], [], get_adapter(model).kind_of) is layer


def test_alpha_zero_equals_dropping(family):
    model = tiny_model(family, layers=5)
    cand = Candidate.from_keep(5, {2, 3})  # groups (0) (1,2,3) (4), alpha 0
    dropped = remove_layers(copy.deepcopy(model), [2, 3])
    assert torch.allclose(logits(build_model(model, cand)), logits(dropped), atol=1e-5)


def test_alpha_one_equals_laco_sum_merge():
    model = tiny_model("llama", layers=4)
    layers = get_adapter(model).decoder_layers(model)
    merged = collapse_group([layers[1], layers[2], layers[3]], uniform_alphas(1.0, 2), get_adapter(model).kind_of)
    for name, p in merged.state_dict().items():
        s = [layer.state_dict()[name] for layer in layers[1:4]]
        assert torch.allclose(p, s[1] + s[2] - s[0], atol=1e-6), name  # RDSC: theta_l + sum (theta_j - theta_l)
    ident = Candidate(tuple((i,) for i in range(4)), tuple(() for _ in range(4)))
    cand = merge_groups(ident, 1, 3)
    assert cand.groups == ((0,), (1, 2, 3)) and cand.layer_map()[1]["alpha"]["mlp"] == [1.0, 1.0]


def test_per_kind_alphas_apply_to_their_modules():
    model = tiny_model("llama", layers=2)
    adapter = get_adapter(model)
    l0, l1 = adapter.decoder_layers(model)
    merged = collapse_group([l0, l1], [{"attention": 1.0, "mlp": 0.0, "norm": 0.5}], adapter.kind_of)
    sd, s0, s1 = merged.state_dict(), l0.state_dict(), l1.state_dict()
    assert torch.allclose(sd["self_attn.q_proj.weight"], s1["self_attn.q_proj.weight"], atol=1e-6)
    assert torch.equal(sd["mlp.up_proj.weight"], s0["mlp.up_proj.weight"])
    assert torch.allclose(sd["input_layernorm.weight"], 0.5 * (s0["input_layernorm.weight"] + s1["input_layernorm.weight"]))


def test_topk_kl_matches_exact_kl_with_full_vocab():
    p = torch.log_softmax(torch.randn(5, 32), -1)
    q = torch.log_softmax(torch.randn(5, 32), -1)
    v, i = p.topk(32, -1)
    exact = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(topk_kl(q, i, v), exact, atol=1e-5)
    v8, i8 = p.topk(8, -1)
    assert (topk_kl(q, i8, v8) >= -1e-6).all()
    assert torch.allclose(topk_kl(p, i8, v8), torch.zeros(5), atol=1e-5)
