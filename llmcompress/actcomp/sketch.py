"""The math of activation compression, as pure functions (tensors in, tensors out; no state).

A linear layer y = x Wᵀ + b needs, for its weight gradient dW = δᵀ X (δ: output gradient, N × d_out;
X: input, N × d_in), the whole input X. Saving the sketch X·P instead, with P a d_in × r random matrix
scaled so that E[P Pᵀ] = I, gives the estimate

    dW ≈ (δᵀ X P) Pᵀ,    E[(δᵀ X P) Pᵀ] = δᵀ X E[P Pᵀ] = dW      (unbiased)

at r/d_in of X's memory. Its variance, for Gaussian P (entries N(0, 1/r)), is
E‖A P Pᵀ − A‖²_F = (d_in + 1)/r · ‖A‖²_F with A = δᵀX; Rademacher P (±1/√r) has at most that. The input
gradient dX = δ W needs only W and stays exact, and so does the bias gradient (δ summed over tokens).

Co-compression: the estimate is already a product of factors, U = δᵀ(XP) (d_out × r) and V = Pᵀ
(r × d_in); handing U and V on (to an optimizer step or to gradient communication) loses nothing more.

Written here by hand: torch has no sketched-gradient linear and no projection regenerable from a seed;
the few lines below are the whole algorithm (CompAct / the activation-compression paper's estimator).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("gaussian", "rademacher")
_MASK = (1 << 64) - 1


def projection_seed(base: int, step: int, draw: int) -> int:
    """A 63-bit seed for the projection of draw `draw` of training step `step` (splitmix64 mixing).

    Each sketched input gets its own draw, so its P is independent of every other one and is regenerated
    in backward from the seed alone (P is never stored).
    """
    z = (base * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + draw * 0x94D049BB133111EB + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def projection(d: int, r: int, seed: int, kind: str = "gaussian", *, device=None, dtype=None) -> torch.Tensor:
    """The d × r projection P with E[P Pᵀ] = I: Gaussian N(0, 1/r) or Rademacher ±1/√r entries.

    The same (d, r, seed, kind, device) always gives the same P (drawn in fp32, then cast to `dtype`).
    """
    import torch

    if kind not in KINDS:
        raise ValueError(f"unknown projection kind {kind!r}; use one of {KINDS}")
    device = torch.device(device or "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    if kind == "gaussian":
        p = torch.randn(d, r, generator=gen, device=device, dtype=torch.float32)
    else:
        p = torch.randint(0, 2, (d, r), generator=gen, device=device).to(torch.float32).mul_(2).sub_(1)
    p.mul_(1.0 / math.sqrt(r))
    return p if dtype is None else p.to(dtype)


def sketch(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """X·P for X (..., d) flattened to (N, d): the (N, r) tensor saved in place of X."""
    return x.reshape(-1, x.shape[-1]).to(p.dtype) @ p


def grad_factors(delta: torch.Tensor, xs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight gradient's factors U = δᵀ(XP) (d_out × r) and V = Pᵀ (r × d_in), in fp32."""
    d2 = delta.reshape(-1, delta.shape[-1])
    u = (d2.to(xs.dtype).t() @ xs).float()
    return u, p.float().t()


def weight_grad(delta: torch.Tensor, xs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The unbiased estimate (δᵀ X P) Pᵀ of dW = δᵀ X (fp32, d_out × d_in)."""
    u, v = grad_factors(delta, xs, p)
    return u @ v


def resolve_rank(rank: int | float | None, d: int) -> int | None:
    """Rank for an input of width d: an int as is, a float in (0, 1) as a fraction of d (at least 1);
    None (or a rank >= d, where a sketch would not save memory) means: save X exactly."""
    if rank is None:
        return None
    r = max(1, int(round(rank * d))) if isinstance(rank, float) else int(rank)
    return None if r >= d else r


def allocate_ranks(dims: list[int], budget: float, scores: list[float] | None = None) -> list[int | None]:
    """Per-input ranks whose sketches hold `budget` of the uncompressed bytes, sum(r_i) = budget * sum(d_i).

    Without scores every input gets round(budget * d_i). With scores s_i = ‖δᵀX‖²_F of each input's
    consumers (estimated from the sketches themselves, see ActCompressor), the total gradient variance
    Σ (d_i + 1) s_i / r_i is minimised under the byte budget: r_i ∝ √((d_i + 1) s_i) (Lagrange), water-filled
    so that no r_i exceeds d_i or falls below 1. A rank equal to d_i comes back as None (saved exactly).
    All inputs see the same tokens, so bytes are proportional to ranks.
    """
    n = len(dims)
    total = budget * sum(dims)
    if scores is None or not any(s > 0 for s in scores):
        ranks = [max(1, round(budget * d)) for d in dims]
    else:
        w = [math.sqrt((d + 1) * max(s, 0.0)) for d, s in zip(dims, scores)]
        fixed: dict[int, float] = {}
        while True:  # water-filling: clamp at d_i, redistribute the rest
            free = [i for i in range(n) if i not in fixed]
            left = total - sum(fixed.values())
            wsum = sum(w[i] for i in free)
            alloc = {i: (left * w[i] / wsum if wsum > 0 else left / max(1, len(free))) for i in free}
            over = [i for i in free if alloc[i] >= dims[i]]
            if not over:
                break
            for i in over:
                fixed[i] = dims[i]
        real = {**fixed, **alloc}
        ranks = [min(dims[i], max(1, math.floor(real[i]))) for i in range(n)]
        spare = round(total) - sum(ranks)  # largest remainders get the leftover units
        for i in sorted(range(n), key=lambda i: real[i] - math.floor(real[i]), reverse=True):
            if spare <= 0:
                break
            if ranks[i] < dims[i]:
                ranks[i] += 1
                spare -= 1
    return [None if r >= d else r for r, d in zip(ranks, dims)]
