"""Quantize a model's linear layers by a `MixedPrecisionPlan` (round-to-nearest), in place.

`quantize_model_` replaces each planned weight by its dequantized value (so the model runs with stock
kernels) and returns the integer tensors that a packed checkpoint stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmcompress.quant import primitives as P
from llmcompress.quant.plan import MixedPrecisionPlan

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


@dataclass
class QuantizedWeight:
    """Integer weight of one linear layer with its group scales and zeros (see primitives)."""

    q: torch.Tensor  # (out, in) int32
    scale: torch.Tensor  # (out, G) float32 holding float16 values
    zero: torch.Tensor  # (out, G) int32
    bits: int
    group_size: int
    sym: bool = False  # zero is 2**(bits-1) everywhere

    def dequantize(self, dtype=None) -> torch.Tensor:
        return P.dequantize(self.q, self.scale, self.zero, self.group_size, dtype)

    def nbytes(self) -> int:
        out, inp = self.q.shape
        return P.quantized_nbytes(out, inp, self.bits, self.group_size)


def linear_fqns(model: nn.Module) -> list[str]:
    import torch.nn as nn

    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_model_(model: nn.Module, plan: MixedPrecisionPlan, progress: bool = True) -> dict[str, QuantizedWeight]:
    """RTN-quantize every linear the plan names; weights become their dequantized values (in place)."""
    import torch

    from llmcompress.progress import track

    modules = dict(model.named_modules())
    targets = plan.quantized(linear_fqns(model))
    out: dict[str, QuantizedWeight] = {}
    items = list(targets.items())
    for fqn, cfg in track(items, "quantizing (RTN)") if progress else items:
        lin = modules[fqn]
        q, s, z = P.quantize(lin.weight.data, cfg.bits, cfg.group_size, sym=cfg.sym)
        qw = QuantizedWeight(q, s, z, cfg.bits, cfg.group_size, cfg.sym)
        with torch.no_grad():
            lin.weight.copy_(qw.dequantize(lin.weight.dtype))
        out[fqn] = qw
    return out
