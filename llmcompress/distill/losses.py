"""Distillation losses: tensor in, scalar tensor out (pure; differentiable).

The logit KL is the shared `llmcompress.metrics.kl_logits`, named here so that the engine (and tests that
interrupt it) reach every loss through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcompress.metrics import kl_logits

if TYPE_CHECKING:
    import torch


def normalized_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token relative squared error ||pred - target||^2 / ||target||^2, averaged over tokens.

    Normalising each token by its own target energy makes the loss scale-free (hidden-state scale grows
    with depth, so segments become comparable for the difficulty ordering) and stops a few huge-norm
    tokens (attention sinks, whose states are easy to reproduce) from dominating the gradient.
    """
    p, t = pred.float(), target.float()
    energy = t.pow(2).sum(-1)
    err = (p - t).pow(2).sum(-1)
    return (err / energy.clamp_min(energy.mean().detach() * 1e-6 + 1e-12)).mean()


def cosine_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of 1 - cos(pred, target) along the hidden dimension."""
    import torch.nn.functional as F

    return (1.0 - F.cosine_similarity(pred.float(), target.float(), dim=-1)).mean()


def hidden_loss(kind: str, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mse":
        return normalized_mse(pred, target)
    if kind == "cosine":
        return cosine_loss(pred, target)
    raise ValueError(f"unknown hidden loss {kind!r}")


def next_token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., V) against the token ids `targets` (...) they should predict."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten().long())


def optimizer_step(opt, params, loss: torch.Tensor, max_norm: float = 1.0) -> float:
    """One training step on `loss` (zero grads, backward, clip to `max_norm`, step); returns the loss value.
    `opt` is a torch optimizer or, with --act-grad factored, an actcomp FactoredStep (actcomp/optim.py)."""
    from llmcompress.actcomp.optim import clip_grad_norm_

    opt.zero_grad(set_to_none=True)
    loss.backward()
    clip_grad_norm_(opt, params, max_norm)
    opt.step()
    return loss.item()


def logit_objective(student_logits, teacher_logits, ids, temperature: float = 1.0, ce_weight: float = 0.0):
    """KL(teacher || student) on all positions plus `ce_weight` x next-token CE on `ids` (B, T).

    Position t's logits predict ids[:, t + 1], so the CE skips the last position. Returns (loss, parts)
    with the parts' float values for the log.
    """
    kl = kl_logits(student_logits, teacher_logits, temperature)
    parts = {"kl": float(kl.detach())}
    if ce_weight <= 0:
        return kl, parts
    ce = next_token_ce(student_logits[:, :-1], ids[:, 1:])
    parts["ce"] = float(ce.detach())
    return kl + ce_weight * ce, parts
