"""The collapse operator, as pure tensor functions.

A group of consecutive decoder layers l..l+k becomes one layer with parameters

    theta = theta_l + sum_j alpha_j * (theta_{l+j} - theta_l)

alpha_j = 1 for every j is LaCo's RDSC merge; alpha_j = 0 drops layer l+j. Coefficients may differ per
merged layer and per module kind (attention, MLP, norms).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from llmcompress.collapse.config import KINDS

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


def merge_tensors(base: torch.Tensor, others: Sequence[torch.Tensor], alphas: Sequence[float]) -> torch.Tensor:
    """theta_l + sum_j alpha_j (theta_{l+j} - theta_l); a new tensor (inputs untouched)."""
    if len(others) != len(alphas):
        raise ValueError("one alpha per merged tensor")
    out = base.detach().clone()
    for other, a in zip(others, alphas):
        if a != 0.0:
            out.add_(other.detach() - base.detach(), alpha=float(a))
    return out


def merge_into_(target: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor],
                alpha: Mapping[str, float], kind_of) -> None:
    """One merged layer's step, in place: target[name] += alpha[kind] * (other[name] - base[name]) for every
    floating tensor (kind_of maps a parameter name to its kind; "other" follows "mlp"; a zero coefficient
    skips the tensor, so a dropped layer changes nothing). Starting from a copy of `base` and applying the
    merged layers in order is `merge_tensors` per tensor, bit for bit; the streamed path (collapse/stream.py)
    thus holds the leader, the result and one source at a time, whatever the group's size."""
    for name, t in target.items():
        if not t.is_floating_point():
            continue
        kind = kind_of(name)
        a = float(alpha[kind if kind in KINDS else "mlp"])
        if a != 0.0:
            t.add_(other[name].detach() - base[name].detach(), alpha=a)


def collapse_group(layers: Sequence[nn.Module], alphas: Sequence[Mapping[str, float]], kind_of) -> nn.Module:
    """One new layer from a group of layers (leader first); `alphas[j]` maps module kind -> coefficient of
    layer j+1. A group of one returns the layer itself."""
    if len(layers) == 1:
        return layers[0]
    if len(layers) - 1 != len(alphas):
        raise ValueError("one alpha mapping per merged layer")
    import torch

    new = copy.deepcopy(layers[0])
    with torch.no_grad():
        target, base = new.state_dict(), layers[0].state_dict()
        for layer, alpha in zip(layers[1:], alphas):
            merge_into_(target, base, layer.state_dict(), alpha, kind_of)
    return new


def uniform_alphas(value: float, n: int) -> list[dict[str, float]]:
    """n coefficient mappings, every kind set to `value` (1.0 = LaCo merge, 0.0 = drop)."""
    return [{k: float(value) for k in KINDS} for _ in range(n)]
