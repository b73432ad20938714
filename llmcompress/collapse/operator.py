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


def merge_state_dicts(
    states: Sequence[Mapping[str, torch.Tensor]],
    alphas: Sequence[Mapping[str, float]],
    kind_of,
) -> dict[str, torch.Tensor]:
    """Merge the state dicts of a group (leader first); `alphas[j]` maps kind -> alpha of layer j+1.

    Args:
        states: state dicts of layers l, l+1, ..., l+k (names relative to the layer).
        alphas: for each merged layer l+1..l+k, a mapping module kind -> coefficient.
        kind_of: parameter name -> kind ("attention", "mlp", "norm", "other"); "other" follows "mlp".
    """
    base, rest = states[0], states[1:]
    if len(rest) != len(alphas):
        raise ValueError("one alpha mapping per merged layer")
    merged = {}
    for name, t in base.items():
        if not t.is_floating_point():
            merged[name] = t.clone()
            continue
        kind = kind_of(name)
        kind = kind if kind in KINDS else "mlp"
        merged[name] = merge_tensors(t, [s[name] for s in rest], [a[kind] for a in alphas])
    return merged


def collapse_group(layers: Sequence[nn.Module], alphas: Sequence[Mapping[str, float]], kind_of) -> nn.Module:
    """One new layer from a group of layers (leader first). A group of one returns the layer itself."""
    if len(layers) == 1:
        return layers[0]
    new = copy.deepcopy(layers[0])
    sd = merge_state_dicts([layer.state_dict() for layer in layers], alphas, kind_of)
    new.load_state_dict(sd)
    return new


def uniform_alphas(value: float, n: int) -> list[dict[str, float]]:
    """n coefficient mappings, every kind set to `value` (1.0 = LaCo merge, 0.0 = drop)."""
    return [{k: float(value) for k in KINDS} for _ in range(n)]
