"""`nas --mode sequential` is a sensible NAS-then-quantize pipeline (issue 19): its bits stage cannot move the
architecture, at an average-bits target it is the mixed-precision-only search, its oracle split and
quantization-aware stage 1 are scored by the validated step, which can fall back to uniform."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.nas.config import NasConfig
from llmcompress.nas.cost import build_cost_models
from llmcompress.nas.qbank import build_bank
from llmcompress.nas.refine import arch_kl
from llmcompress.nas.search import search_sequential, search_uniform
from llmcompress.nas.sensitivity import reference_logp
from llmcompress.nas.space import Arch, build_space, repair
from llmcompress.nas.supernet import Supernet, one_hot_logits

IDS = torch.randint(3, TINY_VOCAB, (24, 32), generator=torch.Generator().manual_seed(1))
BLOCKS, HELD = IDS[:16], IDS[16:]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", layers=4)
    space = build_space(model, NasConfig(target_bits=3.0, bits=[2, 3, 4, 5, 6, 8]))
    return model, space, build_cost_models(model, space, "analytic", 32), build_bank(model, space, "rtn", progress=False)


def _cfg(**kw):
    return NasConfig(bits=[2, 3, 4, 5, 6, 8], train_tokens=512, seq_len=32, batch_size=4, context_len=32, refine_blocks=4, **kw)


def test_bits_repair_of_a_fixed_architecture_never_skips_a_layer(tiny):
    """The 2.7M-perplexity bug: with the architecture pinned (one-hot logits of +-30) and proxy-scaled bit
    logits (hundreds), skipping the layer with the most bits was the cheapest way to lower the *average*."""
    _, space, costs, _ = tiny
    arch = Arch.dense(space, space.bits.index(3))
    arch.bits[0] = [space.bits.index(8)] * len(space.linears)  # over budget because of layer 0
    logits = {"keep": torch.stack([one_hot_logits(2, 1)] * space.n_layers),
              "width": torch.stack([one_hot_logits(len(space.widths), len(space.widths) - 1)] * space.n_layers),
              "bits": -500.0 * (len(space.bits) - 1 - torch.arange(len(space.bits), dtype=torch.float32)).expand(
                  space.n_layers, len(space.linears), -1).clone()}
    free = repair(space, arch, logits, costs, {"bits": 3.0})
    assert not all(free.keep)  # the unrestricted repair does skip (this is what went wrong)
    fixed = repair(space, arch, logits, costs, {"bits": 3.0}, {"bits"})
    assert fixed.keep == arch.keep and fixed.width == arch.width
    assert costs.metrics(fixed)["bits"] <= 3.0 + 1e-9


@pytest.mark.parametrize("steps", [0, 2])
def test_at_a_bits_target_sequential_is_mixed_precision_only_and_never_worse_than_uniform(tmp_path, tiny, steps):
    model, space, costs, bank = tiny
    cfg = _cfg(target_bits=3.0, search_steps=steps)
    res = search_sequential(model, space, costs, cfg, BLOCKS, tmp_path, False, HELD, bank=bank)
    assert all(res.arch.keep) and res.arch.width == [len(space.widths) - 1] * space.n_layers
    assert "mixed-precision-only" in res.note and costs.metrics(res.arch)["bits"] <= 3.0 + 1e-9
    assert set(res.refine["start_kl"]) == {"mixed-precision-only", "uniform"}
    net = Supernet(model, space, bank)
    ref = reference_logp(model, HELD)
    uni = arch_kl(model, net, search_uniform(space, costs, cfg).arch, HELD, ref)
    assert arch_kl(model, net, res.arch, HELD, ref) <= uni + 1e-6  # measured independently of refine's record


def test_latency_target_runs_the_oracle_split_and_quant_aware_stage1(tmp_path, tiny):
    model, space, costs, bank = tiny
    levels = [costs.metrics(Arch.dense(space, k))["latency"] for k in range(len(space.bits))]
    target = (levels[1] + levels[2]) / 2  # between uniform 3 and 4 bits: 4 bits must prune, 3 bits fits
    cfg = _cfg(target_latency=target, search_steps=0, sequential_splits=[1.0, 0.6, 0.2])
    res = search_sequential(model, space, costs, cfg, BLOCKS, tmp_path, False, HELD, bank=bank)
    names = set(res.refine["start_kl"])
    # fp@0.2 is below what full precision reaches with half the layers kept: the sweep stops there
    assert {"fp@1", "fp@0.6", "q3", "q4", "uniform"} <= names and "fp@0.2" not in names and "q2" not in names
    assert costs.metrics(res.arch)["latency"] <= target + 1e-9
    net = Supernet(model, space, bank)
    ref = reference_logp(model, HELD)
    kl = arch_kl(model, net, res.arch, HELD, ref)
    assert kl == pytest.approx(min(res.refine["start_kl"].values()), rel=1e-6)
    assert kl <= arch_kl(model, net, search_uniform(space, costs, cfg).arch, HELD, ref) + 1e-6


def test_configs_that_cannot_decide_a_plan_are_refused():
    from llmcompress.errors import UserError

    with pytest.raises(UserError, match="no stage 1"):
        _cfg(target_latency=0.5, mode="sequential", sequential_splits=[], sequential_quant_aware=False).validate()
    with pytest.raises(UserError, match="init_kappa 0"):  # equal logits and no gradient steps: argmax of ties
        _cfg(target_bits=3.0, init_kappa=0.0).validate()
    _cfg(target_bits=3.0, init_kappa=0.0, search_steps=8).validate()
