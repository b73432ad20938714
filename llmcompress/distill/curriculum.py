"""The curriculum, easy to hard (pure functions; see README.md for why it is built this way).

Phase 1 trains segments in order of difficulty (initial distillation loss, easiest first) on the
teacher's cached inputs. Phase 2 walks the network in order; each segment's input moves on a schedule
from the teacher's features to the already-trained student prefix's outputs (what it sees at inference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def difficulty_order(initial_losses: Mapping[int, float]) -> list[int]:
    """Segment indices sorted easy to hard by their initial loss (ties: network order)."""
    return sorted(initial_losses, key=lambda k: (initial_losses[k], k))


def mix_weight(step: int, total: int, start: float = 0.0, end: float = 1.0) -> float:
    """Weight of the student's own input at `step` of `total`: a cosine ramp from `start` to `end`.

    The last step sees exactly `end`; a single-step phase sees `end`.
    """
    if total <= 1:
        return end
    frac = min(max(step / (total - 1), 0.0), 1.0)
    return start + (end - start) * (1 - math.cos(math.pi * frac)) / 2


def mix_inputs(teacher: torch.Tensor, student: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 - alpha) * teacher + alpha * student (same shape)."""
    if alpha <= 0.0:
        return teacher
    if alpha >= 1.0:
        return student
    return teacher.lerp(student, alpha)


def lr_at(step: int, total: int, base: float, final_frac: float = 0.1, warmup: int = 0) -> float:
    """Linear warm-up for `warmup` steps, then cosine decay from `base` to `base * final_frac`."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if total <= 1:
        return base
    frac = min(max((step - warmup) / max(total - warmup - 1, 1), 0.0), 1.0)
    return base * (final_frac + (1 - final_frac) * (1 + math.cos(math.pi * frac)) / 2)


def split_steps(train_tokens: int, tokens_per_step: int, phase1_fraction: float) -> tuple[int, int]:
    """Per-segment optimiser steps of phase 1 and phase 2 for a token budget (at least one step in all)."""
    total = max(1, math.ceil(train_tokens / tokens_per_step))
    p1 = round(total * phase1_fraction)
    return p1, total - p1


def assign_ranks(order: Sequence[int], world_size: int, cost: Mapping[int, float] | None = None) -> dict[int, list[int]]:
    """Spread segments over ranks: greedy longest-first on `cost` (default 1 each), kept in `order` per rank."""
    cost = cost or {k: 1.0 for k in order}
    load = [0.0] * world_size
    owner: dict[int, int] = {}
    for k in sorted(order, key=lambda k: (-cost[k], order.index(k))):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += cost[k]
    return {r: [k for k in order if owner[k] == r] for r in range(world_size)}


def epoch_order(n_items: int, steps: int, seed: int) -> list[int]:
    """Indices for `steps` steps over `n_items` items: seeded permutations, one per pass."""
    import random

    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < steps:
        perm = list(range(n_items))
        rng.shuffle(perm)
        out.extend(perm)
    return out[:steps]
