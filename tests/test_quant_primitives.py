"""Quantization primitives: error bounds, 16-bit near-identity, exact pack/unpack, STE gradients, plans."""

from __future__ import annotations

import pytest
import torch

from llmcompress.quant import primitives as P
from llmcompress.quant.apply import quantize_model_
from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

W = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "bits,floor",
    [
        (2, 6.0),  # measured 6.8 dB
        (3, 12.0),  # measured 14.2
        (4, 18.5),  # measured 20.9
        (8, 42.0),  # measured 45.4
    ],
)
def test_sqnr_floor(bits, floor):
    what = P.quantize_dequantize(W, bits, 64)
    assert P.sqnr_db(W, what) > floor


def test_sixteen_bits_is_near_identity():
    what = P.quantize_dequantize(W, 16, 64)
    assert P.sqnr_db(W, what) > 75.0  # measured 79.8 dB
    torch.testing.assert_close(what, W, rtol=0, atol=1e-4)


def test_more_bits_less_error():
    errs = [float((P.quantize_dequantize(W, b, 32) - W).abs().mean()) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)


def test_codes_in_range_and_zero_exact():
    w = W.clone()
    w[:, :64] = 0.0
    q, s, z = P.quantize(w, 3, 64)
    assert int(q.min()) >= 0 and int(q.max()) <= 7
    assert torch.equal(P.dequantize(q, s, z, 64)[:, :64], torch.zeros(64, 64))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8, 11, 16])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 2**bits, (37, 19), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    packed = P.pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == P.packed_nbytes(q.numel(), bits)
    assert torch.equal(P.unpack(packed, bits, q.numel(), q.shape), q)


def test_ste_gradient_passes_through():
    w = W.clone().requires_grad_(True)
    y = P.fake_quant(w, 2, 64)
    assert not torch.equal(y.detach(), w.detach())
    (y * 3.0).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_bad_inputs():
    with pytest.raises(ValueError):
        P.quantize(W, 1, 64)
    with pytest.raises(ValueError):
        P.quantize(W, 4, 96)  # 256 % 96 != 0
    with pytest.raises(ValueError):
        QuantConfig(bits=17)


def test_plan_lookup_and_round_trip():
    plan = MixedPrecisionPlan()
    plan["model.layers.0.mlp.down_proj"] = QuantConfig(8, 32)
    plan["re:.*mlp.*"] = QuantConfig(3, 32)
    plan["_default"] = None
    assert plan.config_for("model.layers.0.mlp.down_proj").bits == 8
    assert plan.config_for("model.layers.1.mlp.up_proj").bits == 3
    assert plan.config_for("lm_head") is None
    again = MixedPrecisionPlan.from_dict(plan.to_dict())
    assert again.to_dict() == plan.to_dict()


def test_quantize_model_by_plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    before = model[1].weight.detach().clone()
    plan = MixedPrecisionPlan()
    plan["0"] = QuantConfig(4, 32)
    qw = quantize_model_(model, plan, progress=False)
    assert list(qw) == ["0"]
    assert torch.equal(model[0].weight.data, qw["0"].dequantize())
    assert torch.equal(model[1].weight.data, before)
