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
    _accumulate_(out, lambda: base, [lambda o=o: o for o in others], alphas)
    return out


def _accumulate_(out: torch.Tensor, base, others, alphas: Sequence[float]) -> None:
    """out += alpha_j (other_j - base) for j in order, skipping zero coefficients. `base` and `others` are
    callables, so a tensor read from disk is read only when its coefficient is non-zero, and `base` once."""
    b = None
    for other, a in zip(others, alphas):
        if a != 0.0:
            b = base().detach() if b is None else b
            out.add_(other().detach() - b, alpha=float(a))


def merge_group_(target: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], others: Sequence[Mapping[str, torch.Tensor]],
                 alphas: Sequence[Mapping[str, float]], kind_of) -> None:
    """Merge a group in place: `target` starts as a copy of the leader's tensors `base`; `others[j]` holds layer
    j+1's tensors and `alphas[j]` its coefficient per module kind (kind_of maps a parameter name to its kind;
    "other" follows "mlp"). Per floating tensor, `merge_tensors`'s arithmetic, bit for bit. The mappings are
    only indexed, one tensor at a time, so they may read lazily: the streamed path (collapse/stream.py)
    holds the result, one leader tensor and one source tensor, whatever the group's size."""
    if len(others) != len(alphas):
        raise ValueError("one alpha mapping per merged layer")
    for name, t in target.items():
        if not t.is_floating_point():
            continue
        kind = kind_of(name)
        kind = kind if kind in KINDS else "mlp"
        _accumulate_(t, lambda n=name: base[n], [lambda o=o, n=name: o[n] for o in others], [float(a[kind]) for a in alphas])


def collapse_group(layers: Sequence[nn.Module], alphas: Sequence[Mapping[str, float]], kind_of) -> nn.Module:
    """One new layer from a group of layers (leader first); `alphas[j]` maps module kind -> coefficient of
    layer j+1. A group of one returns the layer itself."""
    if len(layers) == 1:
        return layers[0]
    import torch

    new = copy.deepcopy(layers[0])
    with torch.no_grad():
        merge_group_(new.state_dict(), layers[0].state_dict(), [layer.state_dict() for layer in layers[1:]], alphas, kind_of)
    return new


def uniform_alphas(value: float, n: int) -> list[dict[str, float]]:
    """n coefficient mappings, every kind set to `value` (1.0 = LaCo merge, 0.0 = drop)."""
    return [{k: float(value) for k in KINDS} for _ in range(n)]
