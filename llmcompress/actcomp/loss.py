"""Chunked cross-entropy through the LM head: the tokens × vocabulary logits are never materialised.

A causal LM's loss is cross_entropy(h Wᵀ, targets) with h the final hidden states (N × d) and W the head
(V × d). The stock path keeps, for backward, the N × V logits and their log-softmax, and backward makes an
N × V gradient: for smollm2 (V = 49,152) at batch 8 × 512 that is 0.75 GiB per fp32 copy, the largest
block of a training step's peak and non-linear, so activation compression cannot touch it. Here the rows
are processed in chunks: each chunk's logits, softmax and gradient are formed, used and freed inside
forward, which keeps only dL/dh (N × d) and, when the head trains, dL/dW (V × d); backward scales them by
the incoming gradient. Computing the gradients in forward costs no extra matmul (recomputing the logits in
backward would cost one more per chunk), and the saved dL/dh is the size of h itself.

Precision is the stock path's: the head matmuls (logits, dL/dh = G·W, dL/dW = Gᵀ·h) run in the autocast
dtype under autocast (bf16 on CPU, as HF's head does; W is cast once per call) and in h's dtype without
it; the logits are upcast to fp32 for log-sum-exp and softmax, as HF's loss does; the loss is fp32, dL/dW
is accumulated over chunks in fp32. So the loss and gradients equal `model(..., labels=).loss`'s up to the
rounding of the low-precision matmuls (bf16: ~1e-2 relative per gradient entry; fp32: ~1e-6).

Why not torch's `F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())` (torch 2.13; this module's
previous path): on CPU there is no bf16 matmul with fp32 output (`mm(out_dtype=)` is CUDA-only), so with fp32
inputs every head matmul runs in fp32 (the stock head runs them in bf16); with bf16 inputs (its CPU
default acc_policy="accurate") it is hardly faster and returns the loss in bf16, accumulated so that at 2,044
rows it came out 10.44 against 10.94 for F.cross_entropy on the same bf16 logits. Head + loss forward +
backward for smollm2 (V = 49,152, d = 576) at 2,044 tokens, one thread, unlocked at load ~5: its fp32 path
10.5-15 s, its bf16 path 9.3 s, the stock bf16 head + HF loss 2.9-4.5 s, this Function 2.3-2.9 s (the
training-step figures are in bench/RESULTS-actcomp.md). `impl="torch"` still selects torch's path (fp32).

`causal_lm_loss(model, input_ids)` is the HF `model(..., labels=).loss` computed this way.

    from llmcompress.actcomp.loss import causal_lm_loss
    loss = causal_lm_loss(model, ids)              # == model(input_ids=ids, labels=ids).loss
    loss.backward()

Not for losses that need the logits themselves (distillation's KL against a teacher's distribution).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
CHUNK_BYTES = 32 << 20  # fp32 bytes of one chunk's logits: 170 rows of a 49k vocabulary


def _chunk_rows(n: int, v: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk such that a chunk's fp32 logits take about `chunk_bytes` (at least 1 row, at most n)."""
    return max(1, min(n, chunk_bytes // (4 * v)))


class _ChunkedCE(torch.autograd.Function):
    """mean over non-ignored rows of CE(h Wᵀ + b, t), head matmuls in `mm_dtype`, softmax in fp32;
    forward computes the gradients chunk by chunk and saves only them.

    Per chunk, in two buffers reused across chunks (a fresh r × V tensor per chunk costs page faults
    comparable to the arithmetic): z = logits in fp32, e = exp(z - max z), s = Σ e; row loss
    log s - (z_t - max z); G = e - s·onehot(t) = s·(softmax - onehot), cast to `mm_dtype`, and the row
    factor c = weight_row / s (weight_row = 1/count, 0 if ignored) is applied to the small side of each
    matmul: dL/dh = c ⊙ (G W), dL/dW += Gᵀ (c ⊙ h), dL/db += Gᵀ c."""

    @staticmethod
    def forward(ctx, h, w, b, t, ignore_index, rows, mm_dtype):
        n = h.shape[0]
        valid = t != ignore_index
        count = int(valid.sum())
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        wm = w.to(mm_dtype)
        wt = wm.t()
        bm = None if b is None else b.to(mm_dtype)
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        rows = min(rows, n)
        zdt = torch.promote_types(mm_dtype, torch.float32)
        low = torch.empty((rows, w.shape[0]), dtype=mm_dtype, device=h.device)  # logits, then G, in mm_dtype
        one = zdt == mm_dtype  # fp32 matmuls: z is the matmul's buffer itself
        z = low if one else torch.empty(low.shape, dtype=zdt, device=h.device)
        for s in range(0, n, rows):
            r = min(rows, n - s)
            hc, tc = h[s:s + r].to(mm_dtype), t[s:s + r].clamp(min=0)
            lo, zc = low[:r], z[:r]
            if bm is None:
                torch.mm(hc, wt, out=lo)
            else:
                torch.addmm(bm, hc, wt, out=lo)
            if not one:
                zc.copy_(lo)
            m = zc.amax(1, keepdim=True)
            zt = zc.gather(1, tc.unsqueeze(1)).sub_(m)
            se = zc.sub_(m).exp_().sum(1, keepdim=True)
            c = valid[s:s + r].unsqueeze(1).to(zdt) / max(count, 1)
            total += ((se.log() - zt) * c).sum(dtype=torch.float64)
            if need_h or need_w or need_b:
                zc.scatter_add_(1, tc.unsqueeze(1), -se)
                c = c / se
                if not one:
                    lo.copy_(zc)
                if need_h:
                    gh[s:s + r] = (lo @ wm).to(zdt).mul_(c)
                if need_w:
                    gw += lo.t() @ (hc * c.to(mm_dtype))
                if need_b:
                    gb += (lo.t().to(zdt) @ c).squeeze(1)
        ctx.save_for_backward(*(x for x in (gh, gw, gb) if x is not None))
        ctx.has = (need_h, need_w, need_b)
        ctx.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
        return (total * max(count, 1) / count).to(zdt)  # nan when every row is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        out = [(next(saved) * grad).to(dt) if has else None for has, dt in zip(ctx.has, ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
                          ignore_index: int = IGNORE, impl: str = "chunked", chunk_rows: int | None = None) -> torch.Tensor:
    """cross_entropy(F.linear(hidden, weight, bias).float(), target, ignore_index=...) (mean over non-ignored
    rows), without the N × V logits: `hidden` (..., d), `weight` (V, d), `target` (...) int64.

    The head matmuls run in the autocast dtype under autocast and in `hidden`'s dtype otherwise (as the
    stock head would), log-sum-exp and softmax in fp32; the loss is fp32 and each gradient has its
    input's dtype. impl: "chunked" (the Function above), "torch" (torch's F.linear_cross_entropy chunked
    path, all in fp32: slower on CPU, see the module docstring). chunk_rows: rows per chunk of "chunked"
    (default: as many as make CHUNK_BYTES of fp32 logits).
    """
    if impl not in ("torch", "chunked"):
        raise ValueError(f"impl must be chunked or torch (got {impl!r})")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    dev = h.device.type
    if impl == "torch":
        if not (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")):
            raise ValueError(f"this torch ({torch.__version__}) has no F.linear_cross_entropy; use impl='chunked'")
        dt = torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(dev, enabled=False):
            return F.linear_cross_entropy(h.to(dt), weight.to(dt), t, linear_bias=None if bias is None else bias.to(dt),
                                          ignore_index=ignore_index, options=torch.nn.LinearCrossEntropyOptions())
    mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    with torch.autocast(dev, enabled=False):
        rows = chunk_rows or _chunk_rows(h.shape[0], weight.shape[0])
        return _ChunkedCE.apply(h, weight, bias, t, ignore_index, rows, mm_dtype)


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   *, impl: str = "chunked") -> torch.Tensor:
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
