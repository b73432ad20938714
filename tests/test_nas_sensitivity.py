"""The sensitivity proxy that initialises the NAS logits, and the budget-filling upgrade after repair."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_nas_setup

from llmcompress.nas import sensitivity as S
from llmcompress.nas.space import (
    Arch,
    apply_move,
    repair,
    up_moves,
    upgrade,
    violation,
)
from llmcompress.quant.primitives import quantize_dequantize

IDS = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def setup():
    model, cfg, space, costs = tiny_nas_setup(IDS)
    return model, cfg, space, costs


def test_weighted_error_is_the_expected_output_error():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 64, generator=g)
    sigma = torch.rand(64, generator=g) * 3
    x = torch.randn(200_000, 64, generator=g) * sigma  # independent inputs: the diagonal proxy is exact
    W_hat = quantize_dequantize(W, 3, 16)
    direct = ((x @ (W - W_hat).T) ** 2).sum(-1).mean()
    assert S.weighted_error(W, W_hat, x.pow(2).mean(0)) == pytest.approx(float(direct), rel=0.02)


def test_sensitivity_orders_choices(setup):
    model, _, space, _ = setup
    sens = S.measure(model, space, IDS)
    b = sens.bits
    assert torch.all(b[..., :-1] >= b[..., 1:])  # more bits, less error
    assert torch.all(b[..., 0] > 0) and float(b[..., -1].max()) < 1e-3 * float(b[..., 0].min())
    assert torch.all(sens.width[:, :-1] > sens.width[:, 1:]) and torch.all(sens.width[:, -1] == 0)
    assert torch.all(sens.skip > 0)
    logits = S.init_logits(sens)
    arch_keep = (logits["keep"][:, 1] > logits["keep"][:, 0]).all()
    assert arch_keep and torch.all(logits["width"].argmax(-1) == len(space.widths) - 1)


def test_upgrade_fills_the_budget_and_keeps_targets(setup):
    model, cfg, space, costs = setup
    targets = cfg.targets()
    logits = S.init_logits(S.measure(model, space, IDS))
    low = repair(space, Arch.dense(space, 0), logits, costs, targets)  # already feasible: 2 bits everywhere
    up = upgrade(space, low, logits, costs, targets)
    m_low, m_up = costs.metrics(low), costs.metrics(up)
    assert violation(m_up, targets) == 0 and m_up["bits"] > m_low["bits"] + 1.0
    for move in up_moves(space, up):  # maximal: no single raise that the logits favour still fits
        new = apply_move(up, move, +1)
        assert violation(costs.metrics(new), targets) > 0 or float(_gain(logits, up, new)) <= 0


def _gain(logits, old, new):
    from llmcompress.nas.space import _logit_drop

    diff = [(i, j) for i in range(len(old.bits)) for j in range(len(old.bits[i])) if old.bits[i][j] != new.bits[i][j]]
    if diff:
        return _logit_drop(logits, new, ("bits", *diff[0]))
    i = next(i for i in range(len(old.width)) if old.width[i] != new.width[i] or old.keep[i] != new.keep[i])
    return _logit_drop(logits, new, ("width" if old.width[i] != new.width[i] else "skip", i, None))


def test_proxy_finds_the_fragile_linear_that_measurement_finds():
    """Judged by measured KL, not by the proxy: with one linear made fragile (an outlier in every group, so
    low-bit groups round its other weights coarsely), quantizing that linear alone costs the most measured
    KL, and the calibrated proxy ranks it first too. And the calibrated proxies of a layer add up to the KL
    measured with all its linears at the lowest bits (what calibration promises)."""
    from conftest import tiny_model

    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.refine import arch_kl
    from llmcompress.nas.space import build_space
    from llmcompress.nas.supernet import Supernet

    torch.manual_seed(0)
    model = tiny_model("llama", layers=4)
    space = build_space(model, NasConfig(target_bits=4.0, bits=[2, 4, 16]))
    lin = dict(model.named_modules())[space.fqn(2, "self_attn.v_proj")]
    with torch.no_grad():
        lin.weight[:, :: space.group_size] = 4 * lin.weight.abs().max()
    calib, held = IDS[:4], IDS[4:]
    sens = S.calibrate(model, space, calib, S.measure(model, space, IDS))
    net = Supernet(model, space)
    ref = S.reference_logp(model, held)
    k4 = space.bits.index(4)
    measured = torch.zeros(space.n_layers, len(space.linears))
    for i in range(space.n_layers):
        for j in range(len(space.linears)):
            a = Arch.dense(space)
            a.bits[i][j] = k4
            measured[i, j] = arch_kl(model, net, a, held, ref)
    planted = 2 * len(space.linears) + space.linears.index("self_attn.v_proj")
    assert int(measured.flatten().argmax()) == planted  # the model: the planted linear is the fragile one
    assert int(sens.bits[..., k4].flatten().argmax()) == planted  # the proxy agrees
    ref_c = S.reference_logp(model, calib)
    for i in (0, 3):
        a = Arch.dense(space)
        a.bits[i] = [0] * len(space.linears)
        assert float(sens.bits[i, :, 0].sum()) == pytest.approx(arch_kl(model, net, a, calib, ref_c), rel=1e-3)


def test_calibrated_proxy_predicts_kl_and_restores_model(setup):
    model, _, space, _ = setup
    with torch.no_grad():
        before = model(input_ids=IDS[:2], use_cache=False).logits
    sens = S.calibrate(model, space, IDS[:4], S.measure(model, space, IDS))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS[:2], use_cache=False).logits, before, rtol=0, atol=0)
    # predict a configuration that calibration did not measure: every linear at 8 bits
    k8 = space.bits.index(8)
    predicted = float(sens.bits[..., k8].sum())
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    mods = dict(model.named_modules())
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=IDS[:4], use_cache=False).logits.float(), -1)
        for n, m in mods.items():
            if n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                m.weight.copy_(quantize_dequantize(m.weight, 8, space.group_size))
        logp = torch.log_softmax(model(input_ids=IDS[:4], use_cache=False).logits.float(), -1)
        measured = float((ref.exp() * (ref - logp)).sum(-1).mean())
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    assert predicted / 4 < measured < predicted * 4
    assert torch.all(sens.skip > 0)


def test_linear_kl_is_the_measured_kl_of_each_linear_alone_and_starts_the_bit_logits(setup):
    """`linear_kl` is, entry by entry, the KL that the validated step measures for the plan with that one linear
    at that width (the rest float); it restores every weight; and `bits_init: measured` starts the bit logits
    from it (the calibrated proxy would give other values: a wrong wiring fails the ratio check)."""
    import dataclasses

    from llmcompress.nas import search as SR
    from llmcompress.nas.qbank import build_bank
    from llmcompress.nas.refine import arch_kl
    from llmcompress.nas.supernet import Supernet

    model, cfg, space, _ = setup
    with torch.no_grad():
        before = model(input_ids=IDS[:2], use_cache=False).logits
    bank = build_bank(model, space, "rtn", progress=False)
    net = Supernet(model, space, bank)
    blocks = IDS[:2]
    table = S.linear_kl(model, space, blocks, bank)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS[:2], use_cache=False).logits, before, rtol=0, atol=0)
    ref = S.reference_logp(model, blocks)
    k16 = space.bits.index(16)
    for i, j, k in [(0, 0, 0), (1, 6, 1), (3, 2, 2), (2, 4, 0)]:
        a = Arch.dense(space, k16)
        a.bits[i][j] = k
        assert float(table[i, j, k]) == pytest.approx(arch_kl(model, net, a, blocks, ref), rel=1e-4, abs=1e-9)
    assert torch.all(table[..., k16] == 0) and torch.all(table[..., 0] > table[..., k16 - 1])
    c = dataclasses.replace(cfg, bits_init="measured", sensitivity_blocks=8)  # its // 4 = 2 blocks: `blocks`
    SR._INIT_MEMO.clear()
    got = SR.initial_logits(model, net, c, IDS[:8])["bits"]
    quantized = table[..., :k16] > 0
    ratio = got[..., :k16][quantized] / table[..., :k16][quantized]
    assert float(ratio.max()) < 0 and float(ratio.min()) == pytest.approx(float(ratio.max()), rel=1e-5)
    proxy = SR.initial_logits(model, net, dataclasses.replace(cfg, sensitivity_blocks=8), IDS[:8])["bits"]
    assert not torch.allclose(proxy, got)


def test_init_logits_keep_the_order_of_errors_far_above_the_scale(setup):
    """Repair lowers the choice losing the least logit per unit of cost: errors thousands of times the scale
    must stay ordered (a floor on the logits made them tie, and ties went to layer 0, the costliest skip)."""
    model, cfg, space, costs = setup
    L, nl, nb = space.n_layers, len(space.linears), len(space.bits)
    bits = torch.linspace(1, 0, nb).expand(L, nl, nb).clone()  # scale: the middle width's error, ~0.5
    skip = torch.tensor([1e9, 1e6, 1e4, 1e7])  # layer 2 is the cheapest to skip by far
    logits = S.init_logits(S.Sensitivity(bits, torch.zeros(L, len(space.widths)), skip))
    assert torch.all(logits["keep"][:, 0].argsort() == (-skip).argsort())
    arch = Arch.dense(space, len(space.bits) - 1)
    one_skip = costs.metrics(apply_move(arch, ("skip", 2, None)))["latency"] + 1e-6
    out = repair(space, arch, logits, costs, {"latency": one_skip}, kinds={"skip"})
    assert out.keep == [True, True, False, True]
