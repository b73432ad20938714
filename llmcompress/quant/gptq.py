"""GPTQ (Frantar et al., 2023): round-to-nearest column by column, compensating each column's rounding
error on the columns not yet quantized, weighted by the inverse Hessian H = E[x x^T] of the layer input.

Output uses the same conventions as `primitives` (group-wise asymmetric scales/zeros, float16 scales), so a
GPTQ weight packs, reloads and dequantizes exactly like an RTN one. Group parameters are chosen when the
group's first column is reached, from the already-compensated weights (GPTQ's default, non-static groups).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcompress.quant import primitives as P

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from llmcompress.quant.apply import QuantizedWeight
    from llmcompress.quant.plan import MixedPrecisionPlan


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, *, damp: float = 0.01, block: int = 128,
                  act_order: bool = False, sym: bool = False):
    """Quantize W (out, in) against Hessian H (in, in). Returns (q int32, scale (out, G), zero (out, G)).

    act_order: quantize the columns in order of decreasing Hessian diagonal (the inputs with the most energy
    first, while the most columns remain to absorb their error), with *static* groups: each group's
    scale/zero come from the original weights before any compensation, so the storage layout (group g =
    columns g*group_size..) is unchanged.
    """
    import torch

    P.check_bits(bits)
    out, inp = W.shape
    if inp % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {inp}")
    block = max(group_size, (block // group_size) * group_size)
    W = W.detach().float().clone()
    H = H.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(inp, dtype=H.dtype)
    if act_order:
        static = P.quant_params(W, bits, group_size, sym)  # static groups, from the uncompensated weights
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    else:
        perm = torch.arange(inp)
    try:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    except RuntimeError:  # not positive definite even after damping: fall back to RTN
        return P.quantize(W[:, torch.argsort(perm)], bits, group_size, sym=sym)
    qmax = 2**bits - 1
    G = inp // group_size
    scale, zero = static if act_order else (torch.zeros(out, G), torch.zeros(out, G, dtype=torch.int32))
    Q = torch.zeros(out, inp, dtype=torch.int32)
    for i1 in range(0, inp, block):
        i2 = min(i1 + block, inp)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:
                s, z = P.quant_params(W1[:, i : i + group_size], bits, group_size, sym)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            w = W1[:, i]
            q = (torch.round(w / scale[:, g]) + zero[:, g]).clamp(0, qmax)
            Q[:, col] = q.to(torch.int32)
            err = (w - (q - zero[:, g]) * scale[:, g]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return Q, scale, zero


def input_hessians(model: nn.Module, fqns: list[str], blocks: torch.Tensor, batch: int = 2) -> dict[str, torch.Tensor]:
    """E[x x^T] of each named linear's input over `blocks` (one pass; modules sharing an input share it)."""

    modules = dict(model.named_modules())
    H: dict[str, torch.Tensor] = {}
    hooks = []
    for name in fqns:
        def pre(mod, args, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            H[name] = H.get(name, 0) + x.T @ x
        hooks.append(modules[name].register_forward_pre_hook(pre))
    from llmcompress.io.forward import forward_with_hooks

    n = max(forward_with_hooks(model, blocks, hooks, batch), 1)
    return {k: v / n for k, v in H.items()}


def gptq_model_(model: nn.Module, plan: MixedPrecisionPlan, blocks: torch.Tensor, progress: bool = True,
                act_order: bool = False) -> dict[str, QuantizedWeight]:
    """GPTQ-quantize every linear the plan names (Hessians from one pass of the unquantized model); the
    weights become their dequantized values in place. Returns the integer weights, as quantize_model_.
    act_order: see gptq_quantize."""
    import torch

    from llmcompress.progress import track
    from llmcompress.quant.apply import QuantizedWeight, linear_fqns

    modules = dict(model.named_modules())
    targets = plan.quantized(linear_fqns(model))
    hessians = input_hessians(model, list(targets), blocks)
    out: dict[str, QuantizedWeight] = {}
    items = list(targets.items())
    for fqn, cfg in track(items, "quantizing (GPTQ)") if progress else items:
        lin = modules[fqn]
        q, s, z = gptq_quantize(lin.weight.data, hessians.pop(fqn), cfg.bits, cfg.group_size, act_order=act_order, sym=cfg.sym)
        qw = QuantizedWeight(q, s, z, cfg.bits, cfg.group_size, cfg.sym)
        with torch.no_grad():
            lin.weight.copy_(qw.dequantize(lin.weight.dtype))
        out[fqn] = qw
    return out


__all__ = ["gptq_model_", "gptq_quantize", "input_hessians"]
