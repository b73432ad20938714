"""The validated refinement after the NAS search: level-switch mutations scored by measured KL."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_VOCAB, tiny_nas_setup

from llmcompress.nas import refine as R
from llmcompress.nas.sensitivity import reference_logp
from llmcompress.nas.space import Arch, violation
from llmcompress.nas.supernet import Supernet

IDS = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def setup():
    model, cfg, space, costs = tiny_nas_setup(IDS)
    return model, cfg, space, costs, Supernet(model, space)


def test_mutations_keep_targets_and_respect_kinds(setup):
    _, cfg, space, costs, _ = setup
    targets = cfg.targets()
    start = Arch.dense(space, space.bits.index(4))
    rng = random.Random(0)
    changed_bits = 0
    for _ in range(40):
        new = R.mutate(space, start, costs, targets, rng, kinds={"bits"})
        assert new is not None and not R.same_arch(new, start)
        assert violation(costs.metrics(new), targets) <= 1e-9
        assert new.keep == start.keep and new.width == start.width  # bits only
        changed_bits += sum(a != b for ra, rb in zip(new.bits, start.bits) for a, b in zip(ra, rb))
    assert changed_bits >= 80  # each raises one linear and lowers at least one other
    a = [R.mutate(space, start, costs, targets, random.Random(3)) for _ in range(2)]
    assert R.same_arch(a[0], a[1])  # seeded


def test_arch_kl_measures_the_quantized_model_and_restores_everything(setup):
    model, _, space, _, net = setup
    logits_before = net.logits()
    with torch.no_grad():
        out_before = model(input_ids=IDS[:2], use_cache=False).logits
    ref = reference_logp(model, IDS)
    kls = [R.arch_kl(model, net, Arch.dense(space, space.bits.index(b)), IDS, ref) for b in (2, 4, 8)]
    assert kls[0] > kls[1] > kls[2] > 0
    # the same number as quantizing the weights by hand
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    from llmcompress.quant.primitives import quantize_dequantize

    with torch.no_grad():
        for n, m in model.named_modules():
            if n.endswith(tuple(space.linears)):
                m.weight.copy_(quantize_dequantize(m.weight, 4, space.group_size))
        logp = [torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1) for b in IDS.split(2)]
        by_hand = sum(float((r.exp() * (r - lp)).sum()) for r, lp in zip(ref, logp)) / IDS.numel()
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    assert kls[1] == pytest.approx(by_hand, rel=1e-4)
    for k, v in net.logits().items():
        torch.testing.assert_close(v, logits_before[k], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS[:2], use_cache=False).logits, out_before, rtol=0, atol=0)


def test_refine_starts_from_the_best_candidate_and_only_improves(setup):
    model, cfg, space, costs, net = setup
    targets = {"bits": 4.0}
    bad = Arch.dense(space, space.bits.index(4))
    for j in range(len(space.linears)):  # a poor allocation at the same budget: bits (2, 8, 3, 3) by layer
        for i, b in enumerate((2, 8, 3, 3)):
            bad.bits[i][j] = space.bits.index(b)
    uniform = Arch.dense(space, space.bits.index(4))
    over = Arch.dense(space)  # 16 bits: breaks the target, must be skipped
    records = []
    res = R.refine(model, net, space, costs, targets, {"searched": bad, "uniform": uniform, "over": over}, IDS,
                   evals=12, seed=1, kinds={"bits"}, log=records.append)
    assert set(res.start_kl) == {"searched", "uniform"} and res.start == "uniform"
    assert res.start_kl["uniform"] < res.start_kl["searched"]
    assert res.kl <= res.start_kl["uniform"] and violation(costs.metrics(res.arch), targets) <= 1e-9
    ref = reference_logp(model, IDS)
    assert R.arch_kl(model, net, res.arch, IDS, ref) == pytest.approx(res.kl, rel=1e-6)  # the reported KL is real
    best = [r["best_kl"] for r in records if "step" in r]
    assert best == sorted(best, reverse=True) and res.evaluated == len(best)
    assert res.accepted == sum(r["accepted"] for r in records if "step" in r)
    again = R.refine(model, net, space, costs, targets, {"searched": bad, "uniform": uniform}, IDS, evals=12, seed=1, kinds={"bits"})
    assert R.same_arch(again.arch, res.arch) and again.kl == res.kl  # seeded
    twin = R.refine(model, net, space, costs, targets, {"searched": uniform.copy(), "uniform": uniform}, IDS, evals=0, seed=1)
    assert twin.start_kl["searched"] == twin.start_kl["uniform"] == res.start_kl["uniform"] and twin.start == "searched"
