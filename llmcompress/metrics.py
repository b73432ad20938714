"""Pure tensor functions every engine shares: KL between next-token distributions, Block Influence, tensor digests.

Tensors in, tensors (or floats) out; no model, no I/O. torch is imported inside the functions so that
`import llmcompress` and `--help` stay fast.

- `token_kl`: KL(P || Q) per position from full log-probabilities (nas search loss and sensitivity).
- `kl_logits`: KL(teacher || student) from logits with a temperature, the distillation loss (torch's fused
  `kl_div`, whose backward the distill engine's recorded weights were trained with).
- `topk_kl`: KL(P || Q) with P known only on its top-k tokens plus a tail bucket (collapse's cached reference).
- `block_influence`: ShortGPT's per-layer 1 - cos(input, output) (collapse baselines, distill's BI layer choice).
- `update_tensor_digest`: feed a tensor's dtype, shape and bytes to a hashlib object (weights hashes, cache keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch


def token_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per position: sum over the vocabulary of P * (log P - log Q).

    Args:
        p_logp, q_logp: (..., V) log-probabilities of the reference P (teacher, original) and of Q.
    Returns:
        (...) KL in nats.
    """
    return (p_logp.exp() * (p_logp - q_logp)).sum(-1)


def kl_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) per token, averaged over tokens, scaled by T^2 (Hinton et al.)."""
    import torch.nn.functional as F

    t = temperature
    s = F.log_softmax(student_logits.float().flatten(0, -2) / t, dim=-1)  # (N, V)
    p = F.log_softmax(teacher_logits.float().flatten(0, -2) / t, dim=-1)
    return F.kl_div(s, p, log_target=True, reduction="batchmean") * (t * t)


def topk_kl(logp_q: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per position, with P known on its top-k tokens plus one bucket for the rest.

    Args:
        logp_q: (..., V) candidate log-probabilities.
        top_idx: (..., k) the original's top-k token ids; top_logp: (..., k) their log-probabilities.
    Returns:
        (...) KL in nats; exact when the top-k holds all of P's mass.
    """
    p = top_logp.exp()
    q_top = logp_q.gather(-1, top_idx)
    head = (p * (top_logp - q_top)).sum(-1)
    p_tail = (1.0 - p.sum(-1)).clamp_min(1e-10)
    q_tail = (1.0 - q_top.exp().sum(-1)).clamp_min(1e-10)
    return head + p_tail * (p_tail.log() - q_tail.log())


def block_influence(states: Iterable[torch.Tensor]) -> list[float]:
    """ShortGPT's Block Influence per layer: 1 - mean cosine(input, output) over all tokens.

    Args:
        states: L+1 tensors (..., H) in order, states[i] the input of layer i (io.forward.boundary_states); any
            iterable, so states read one at a time are never all held.
    """
    import torch.nn.functional as F

    scores, prev = [], None
    for s in states:
        if prev is not None:
            scores.append(float(1.0 - F.cosine_similarity(prev.float(), s.float(), dim=-1).mean()))
        prev = s
    return scores


def update_tensor_digest(h, t: torch.Tensor, label: str = "") -> None:
    """Feed `label`, the dtype, the shape and the raw bytes of tensor `t` to the hashlib object `h`."""
    import torch

    t = t.detach().contiguous().cpu()
    h.update(f"{label}{t.dtype}:{tuple(t.shape)}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())


__all__ = ["block_influence", "kl_logits", "token_kl", "topk_kl", "update_tensor_digest"]
