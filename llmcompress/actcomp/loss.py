"""Chunked cross-entropy through the LM head: the tokens × vocabulary logits are never materialised.

A causal LM's loss is cross_entropy(h Wᵀ, targets) with h the final hidden states (N × d) and W the head
(V × d). The stock path keeps, for backward, the N × V logits and their log-softmax, and backward makes an
N × V gradient: for smollm2 (V = 49,152) at batch 8 × 512 that is 0.75 GiB per fp32 copy, the largest
block of a training step's peak and non-linear, so activation compression cannot touch it. Here the rows
are processed in chunks: each chunk's logits, softmax and gradient are formed, used and freed inside
forward, which keeps only dL/dh (N × d) and, when the head trains, dL/dW (V × d); backward scales them by
the incoming gradient. The loss and both gradients are the same as the stock ones (up to float rounding;
computed in fp32, also under bf16 autocast, where the stock head runs in bf16).

`chunked_cross_entropy` uses torch's own `F.linear_cross_entropy` with `LinearCrossEntropyOptions`
(torch >= 2.10 or so; the chunked path of torch 2.13) and, on an older torch, an equivalent
autograd Function written here. `causal_lm_loss(model, input_ids)` is the HF `model(..., labels=).loss`
computed this way.

    from llmcompress.actcomp.loss import causal_lm_loss
    loss = causal_lm_loss(model, ids)              # == model(input_ids=ids, labels=ids).loss
    loss.backward()

Not for losses that need the logits themselves (distillation's KL against a teacher's distribution).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _chunk_rows(n: int, d: int, v: int) -> int:
    """Rows per chunk such that a chunk's logits hold about as many numbers as the input h (N × d)."""
    return max(1, min(n, -(-n // max(1, -(-v // d)))))


class _ChunkedCE(torch.autograd.Function):
    """mean over non-ignored rows of CE(h Wᵀ + b, t); forward computes the gradients chunk by chunk."""

    @staticmethod
    def forward(ctx, h, w, b, t, ignore_index, rows):
        n = h.shape[0]
        valid = t != ignore_index
        count = max(1, int(valid.sum()))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(w) if need_w else None
        gb = torch.zeros_like(b) if need_b else None
        total = torch.zeros((), dtype=torch.float64)
        for s in range(0, n, rows):
            hc, tc, vc = h[s:s + rows], t[s:s + rows], valid[s:s + rows]
            logits = F.linear(hc, w, b)
            lse = torch.logsumexp(logits, -1)
            tgt = logits.gather(1, tc.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse - tgt) * vc).sum().double()
            if need_h or need_w or need_b:
                g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                g[torch.arange(g.shape[0]), tc.clamp(min=0)] -= 1
                g.mul_((vc.to(g.dtype) / count).unsqueeze(1))
                if need_h:
                    gh[s:s + rows] = g @ w
                if need_w:
                    gw.addmm_(g.t(), hc)
                if need_b:
                    gb += g.sum(0)
            del logits
        ctx.save_for_backward(*(x for x in (gh, gw, gb) if x is not None))
        ctx.has = (need_h, need_w, need_b)
        return (total / count).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        out = [next(saved) * grad if has else None for has in ctx.has]
        return out[0], out[1], out[2], None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
                          ignore_index: int = IGNORE, impl: str = "auto") -> torch.Tensor:
    """cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=...) (mean over non-ignored rows),
    without the N × V logits: `hidden` (..., d), `weight` (V, d), `target` (...) int64.

    Computed in fp32 (hidden and weight upcast if lower), with autocast off; the loss is fp32 and the
    gradient reaching `hidden` has its dtype. impl: "torch" (F.linear_cross_entropy, chunked), "chunked"
    (the Function above), "auto" (torch's where it exists).
    """
    if impl not in ("auto", "torch", "chunked"):
        raise ValueError(f"impl must be auto, torch or chunked (got {impl!r})")
    has_torch = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
    if impl == "torch" and not has_torch:
        raise ValueError(f"this torch ({torch.__version__}) has no F.linear_cross_entropy; use impl='chunked'")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    dt = torch.promote_types(h.dtype, torch.float32)
    with torch.autocast(h.device.type, enabled=False):
        h, w = h.to(dt), weight.to(dt)
        b = None if bias is None else bias.to(dt)
        if impl != "chunked" and has_torch:
            return F.linear_cross_entropy(h, w, t, linear_bias=b, ignore_index=ignore_index,
                                          options=torch.nn.LinearCrossEntropyOptions())
        return _ChunkedCE.apply(h, w, b, t, ignore_index, _chunk_rows(h.shape[0], h.shape[1], w.shape[0]))


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   *, impl: str = "auto") -> torch.Tensor:
    """`model(input_ids=..., labels=...).loss` of an HF causal LM (next-token CE, labels shifted by one,
    -100 ignored), with the head and loss through `chunked_cross_entropy`: the decoder runs as usual and
    the logits are never materialised. Refuses models whose logits are not a plain linear of the last hidden
    state (final logit soft-capping, logit scaling)."""
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"causal_lm_loss: the model's logits use {attr}={getattr(cfg, attr)!r}; use the model's own loss")
    head = model.get_output_embeddings()
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    labels = input_ids if labels is None else labels
    return chunked_cross_entropy(hidden[:, :-1], head.weight, labels[:, 1:], bias=getattr(head, "bias", None), impl=impl)
