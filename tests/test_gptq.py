"""GPTQ: lower output error than round-to-nearest on correlated inputs, same storage conventions."""

from __future__ import annotations

import pytest
import torch

from llmcompress.quant import primitives as P
from llmcompress.quant.gptq import gptq_quantize


def _data(seed=0, out=32, inp=128, n=4096):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g)
    mix = torch.randn(inp, inp, generator=g) / inp**0.5 + torch.eye(inp)  # correlated input features
    x = torch.randn(n, inp, generator=g) @ mix
    return W, x


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_beats_rtn_on_output_error(bits, act_order):
    W, x = _data()
    x = x * torch.linspace(0.2, 3.0, x.shape[1])  # unequal input energies: act-order has something to order
    H = x.T @ x / len(x)
    q, s, z = gptq_quantize(W, H, bits, 32, act_order=act_order)
    assert int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1 and int(z.max()) <= 2**bits - 1
    assert torch.equal(s.to(torch.float16).float(), s)  # float16-representable scales, as RTN stores
    W_gptq = P.dequantize(q, s, z, 32)
    W_rtn = P.quantize_dequantize(W, bits, 32)

    def err(Wh):
        return float(((x @ (W - Wh).T) ** 2).mean())

    assert err(W_gptq) < 0.9 * err(W_rtn)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_exact_for_representable_weights(act_order):
    W, x = _data(1, out=8, inp=64)
    q, s, z = P.quantize(W, 4, 16)
    W_rep = P.dequantize(q, s, z, 16)  # already on the grid: nothing to round, nothing to compensate
    q2, s2, z2 = gptq_quantize(W_rep, x.T @ x / len(x), 4, 16, act_order=act_order)
    torch.testing.assert_close(P.dequantize(q2, s2, z2, 16), W_rep, rtol=0, atol=1e-5)


def test_gptq_model_lowers_logit_error(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    from llmcompress.quant.apply import linear_fqns, quantize_model_
    from llmcompress.quant.gptq import gptq_model_
    from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

    ref = AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval()
    ids = torch.randint(3, ref.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    plan = MixedPrecisionPlan()
    for n in linear_fqns(ref):
        if ".layers." in n:
            plan[n] = QuantConfig(bits=3, group_size=16)
    plan["_default"] = None
    errs = {}
    for name, fn in (("rtn", lambda m: quantize_model_(m, plan, progress=False)),
                     ("gptq", lambda m: gptq_model_(m, plan, ids[:6], progress=False))):
        m = AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval()
        fn(m)
        with torch.no_grad():
            errs[name] = float((m(input_ids=ids[6:]).logits - ref(input_ids=ids[6:]).logits).pow(2).mean())
    assert errs["gptq"] < errs["rtn"]
