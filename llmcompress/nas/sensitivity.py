"""A second-order proxy of what each choice costs in quality, used to initialise the architecture logits.

Every choice is scored in one unit: the error energy it adds to the residual stream, relative to the
stream's own energy at that layer (E||delta||^2 / E||h||^2 per token), from one calibration pass:

* bits b of linear j in layer i: sum_c E[x_c^2] * ||W[:, c] - Q_b(W)[:, c]||^2 (the diagonal-Hessian
  output error of the quantized weight, as in HAWQ/GPTQ's objective);
* MLP width k of layer i: sum over dropped channels c of E[a_c^2] * ||down[:, c]||^2 (the output the
  dropped channels would have added);
* skipping layer i: E||layer(h) - h||^2.

The three proxies are not in comparable units (an error in q_proj does not reach the residual stream as
it is), so `calibrate` rescales them into logit-KL units by measurement: all linears at ~4 bits, all MLPs
at ~half width, and each layer skipped alone. Logits are then `-kappa * error / scale` with `scale` the
median 4-bit error (no clamping that would erase the ordering), so with no search steps the
argmax keeps everything at full quality and the greedy repair lowers first what costs least per unit of
budget (a knapsack on the proxy); the search's gradient steps then correct the proxy with the real KL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmcompress.io.adapters import get_adapter
from llmcompress.io.forward import forward_with_hooks

if TYPE_CHECKING:
    import torch

    from llmcompress.nas.qbank import QuantBank
    from llmcompress.nas.space import SearchSpace


@dataclass
class Sensitivity:
    bits: torch.Tensor  # (L, n_linears, n_bits) relative error energy
    width: torch.Tensor  # (L, n_widths)
    skip: torch.Tensor  # (L,)
    head: torch.Tensor | None = None  # (n_head_bits,) measured KL of the head alone at each width (calibrate)

    def scale(self) -> float:
        """Typical magnitude: the median positive error of the middle bit width (index n_bits // 2: 5 bits of
        2,3,4,5,6,8,16; 8 of 4,5,8,16). Only gradient steps see it: repair, upgrade and argmax are invariant to it."""

        b = self.bits
        col = b.shape[-1] // 2
        v = b[..., col].flatten()
        v = v[v > 0]
        return float(v.median()) if len(v) else 1.0


def input_moments(model, blocks: torch.Tensor, space: SearchSpace, batch: int = 2) -> tuple[dict, list[float], list[float]]:
    """E[x_c^2] of every searched linear's input, E||h||^2 at each layer input and E||layer(h)-h||^2."""

    layers = get_adapter(model).decoder_layers(model)
    m2: dict[tuple[int, int], torch.Tensor] = {}
    resid = [0.0] * space.n_layers
    update = [0.0] * space.n_layers
    hooks = []
    for i, layer in enumerate(layers):
        mods = dict(layer.named_modules())
        for j, name in enumerate(space.linears):
            def pre(mod, args, key=(i, j)):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                m2[key] = m2.get(key, 0) + x.pow(2).sum(0)
            hooks.append(mods[name].register_forward_pre_hook(pre))

        def post(mod, args, kwargs, out, i=i):
            h = (args[0] if args else kwargs["hidden_states"]).detach().float()
            y = (out[0] if isinstance(out, tuple) else out).detach().float()
            resid[i] += float(h.pow(2).sum())
            update[i] += float((y - h).pow(2).sum())
        hooks.append(layer.register_forward_hook(post, with_kwargs=True))
    n = max(forward_with_hooks(model, blocks, hooks, batch), 1)
    return {k: v / n for k, v in m2.items()}, [r / n for r in resid], [u / n for u in update]


def weighted_error(W: torch.Tensor, W_hat: torch.Tensor, m2: torch.Tensor) -> float:
    """sum_c m2_c * ||W[:, c] - W_hat[:, c]||^2: expected squared output error per token."""
    return float(((W.float() - W_hat.float()).pow(2).sum(0) * m2).sum())


def measure(model, space: SearchSpace, blocks: torch.Tensor, bank: QuantBank | None = None) -> Sensitivity:
    """Sensitivity of every choice of `space` on `blocks`, for the weights of `bank` (nas/qbank.py: the ones
    the export ships; default: RTN)."""
    import torch

    from llmcompress.nas.qbank import build_bank

    bank = bank if bank is not None else build_bank(model, space, "rtn", progress=False)
    m2, resid, update = input_moments(model, blocks, space)
    layers = get_adapter(model).decoder_layers(model)
    L, nl, nb, K = space.n_layers, len(space.linears), len(space.bits), len(space.widths)
    bits = torch.zeros(L, nl, nb)
    width = torch.zeros(L, K)
    for i, layer in enumerate(layers):
        mods = dict(layer.named_modules())
        norm = max(resid[i], 1e-12)
        for j, name in enumerate(space.linears):
            W = mods[name].weight.detach()
            for k in range(len(space.bits)):
                Wq = bank.dequant(i, j, k)
                bits[i, j, k] = weighted_error(W, Wq, m2[(i, j)]) / norm
        down = layer.mlp.down_proj.weight.detach().float()
        j_down = space.linears.index("mlp.down_proj")
        per_channel = m2[(i, j_down)] * down.pow(2).sum(0)  # channels are already ranked (prefix = widest kept)
        total = float(per_channel.sum())
        for k, w in enumerate(space.widths):
            width[i, k] = (total - float(per_channel[:w].sum())) / norm
    skip = torch.tensor([u / max(r, 1e-12) for u, r in zip(update, resid)])
    return Sensitivity(bits, width, skip)


def reference_logp(model, blocks: torch.Tensor, batch: int = 2) -> list[torch.Tensor]:
    """The model's next-token log-probabilities on `blocks` (one tensor per batch), for `mean_kl`."""
    import torch

    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1) for b in blocks.split(batch)]


def mean_kl(model, blocks, ref_logp, batch: int = 2) -> float:
    """Mean per-token KL(reference || model now) on `blocks`, against `reference_logp`'s output."""
    import torch

    from llmcompress.metrics import token_kl

    total, n = 0.0, 0
    with torch.no_grad():
        for b, ref in zip(blocks.split(batch), ref_logp):
            logp = torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1)
            total += float(token_kl(ref, logp).sum())
            n += b.numel()
    return total / max(n, 1)


def _bit_factors(model, space: SearchSpace, blocks: torch.Tensor, sens: Sensitivity, bank: QuantBank, ref, batch: int) -> torch.Tensor:
    """(L, n_bits) measured-KL / proxy factors of each layer's bit proxies (see `calibrate`)."""
    import torch

    layers = get_adapter(model).decoder_layers(model)
    # bits: per layer, all its linears quantized at once, at ~4 bits and at the lowest width (errors
    # compound superlinearly there); within a layer the proxy splits the measured KL between the linears;
    # factors in between are interpolated geometrically, above ~4 bits the 4-bit factor holds
    kb = min(range(len(space.bits)), key=lambda k: abs(space.bits[k] - 4))
    levels = sorted({0, kb})
    factor = torch.ones(space.n_layers, len(space.bits))
    for i, layer in enumerate(layers):
        mods = dict(layer.named_modules())
        for k in levels:
            saved = []
            with torch.no_grad():
                for j, name in enumerate(space.linears):
                    W = mods[name].weight
                    saved.append(W.detach().clone())
                    W.copy_(bank.dequant(i, j, k))
            try:
                kl = mean_kl(model, blocks, ref, batch)
            finally:
                with torch.no_grad():
                    for j, name in enumerate(space.linears):
                        mods[name].weight.copy_(saved[j])
            factor[i, k] = max(kl, 1e-12) / max(float(sens.bits[i, :, k].sum()), 1e-30)
        lo, hi = factor[i, 0].log(), factor[i, kb].log()
        for k in range(len(space.bits)):
            if 0 < k < kb:
                factor[i, k] = torch.exp(lo + (hi - lo) * k / kb)
            elif k > kb:
                factor[i, k] = factor[i, kb]
    return factor


def calibrate(model, space: SearchSpace, blocks: torch.Tensor, sens: Sensitivity, bank: QuantBank | None = None, batch: int = 2,
              bits_init: str = "proxy") -> Sensitivity:
    """Put the three kinds of choice in one unit, the logit KL to the teacher, by measuring it: per layer,
    all its linears at ~4 bits and at the lowest bits (scale that layer's bit proxies; the proxy splits the
    layer's KL between its linears), per layer its MLP at ~half width (scales that layer's width proxies),
    and each layer skipped on its own (replaces the skip proxy). 4L + 1 forwards over `blocks`. Weights and
    hooks are restored. (One global scale per kind is not enough: the first layers, which create the
    residual stream's massive activations, have proxies orders of magnitude off.) With `bits_init`
    "measured" the bit sensitivities are `linear_kl` instead (each linear alone at each width), and the
    per-layer bit scaling is not run."""
    import torch

    from llmcompress.nas.qbank import build_bank

    bank = bank if bank is not None else build_bank(model, space, "rtn", progress=False)
    layers = get_adapter(model).decoder_layers(model)
    ref = reference_logp(model, blocks, batch)
    if bits_init == "measured":
        bits = linear_kl(model, space, blocks, bank, ref, batch)
    else:
        bits = sens.bits * _bit_factors(model, space, blocks, sens, bank, ref, batch)[:, None, :]
    kw = min(range(len(space.widths)), key=lambda k: abs(space.widths[k] - space.intermediate / 2))
    # width, one layer at a time
    w = space.widths[kw]
    wfac = torch.ones(space.n_layers)
    for i, layer in enumerate(layers):
        h = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: (torch.cat([a[0][..., :w], torch.zeros_like(a[0][..., w:])], -1),))
        try:
            kl = mean_kl(model, blocks, ref, batch)
        finally:
            h.remove()
        wfac[i] = max(kl, 1e-12) / max(float(sens.width[i, kw]), 1e-30)
    # skip, one layer at a time
    skip = torch.zeros(space.n_layers)
    for i, layer in enumerate(layers):
        def identity(mod, args, kwargs, out):
            h = args[0] if args else kwargs["hidden_states"]
            return (h, *out[1:]) if isinstance(out, tuple) else h
        h = layer.register_forward_hook(identity, with_kwargs=True)
        try:
            skip[i] = mean_kl(model, blocks, ref, batch)
        finally:
            h.remove()
    width = sens.width * wfac[:, None]
    return Sensitivity(bits, width, skip, head_kl(model, space, blocks, bank, ref, batch) if space.head_bits else None)


def head_kl(model, space: SearchSpace, blocks: torch.Tensor, bank: QuantBank, ref: list[torch.Tensor], batch: int = 2) -> torch.Tensor:
    """KL to the teacher with only the output head at each of `space.head_bits` (a tied head is the embedding
    table too: both change, as in the export). One forward pass per width; the weight is restored."""
    import torch

    from llmcompress.nas.qbank import HEAD

    W = model.get_output_embeddings().weight
    saved = W.detach().clone()
    out = torch.zeros(len(space.head_bits))
    try:
        for k in range(len(space.head_bits)):
            with torch.no_grad():
                W.copy_(bank.dequant(HEAD, 0, k) if (HEAD, 0, k) in bank.entries else saved)
            out[k] = mean_kl(model, blocks, ref, batch)
    finally:
        with torch.no_grad():
            W.copy_(saved)
    return out


def linear_kl(model, space: SearchSpace, blocks: torch.Tensor, bank: QuantBank, ref: list[torch.Tensor] | None = None,
              batch: int = 2) -> torch.Tensor:
    """(L, n_linears, n_bits) KL to the teacher with one linear at one of the bank's widths, every other weight
    as it is (float): one forward over `blocks` per linear and quantized width (a float width is 0 without
    one). Each weight is restored. `bits_init: measured` starts the bit logits from it, and the benchmark's
    per-linear knapsack baseline (bench/bench_nas.py) solves on it."""
    import torch

    from llmcompress.progress import track

    ref = ref if ref is not None else reference_logp(model, blocks, batch)
    mods = dict(model.named_modules())
    out = torch.zeros(space.n_layers, len(space.linears), len(space.bits))
    items = [(i, j) for i in range(space.n_layers) for j in range(len(space.linears))]
    for i, j in track(items, "per-linear KL", total=len(items)):
        W = mods[space.fqn(i, space.linears[j])].weight
        saved = W.detach().clone()
        try:
            for k in range(len(space.bits)):
                if (i, j, k) not in bank.entries:  # a float width: the weight as it is
                    continue
                with torch.no_grad():
                    W.copy_(bank.dequant(i, j, k))
                out[i, j, k] = mean_kl(model, blocks, ref, batch)
        finally:
            with torch.no_grad():
                W.copy_(saved)
    return out


def init_logits(sens: Sensitivity, kappa: float = 2.0) -> dict[str, torch.Tensor]:
    """Architecture logits `-kappa * error / scale`; keep vs skip as [-skip, 0].

    Not clamped: repair and upgrade compare logit differences per unit of cost, so a floor would make every
    choice beyond it tie, and ties go to the first candidate. (A floor at -1e4 did that on smollm2-135m
    with bits 4,5,8,16: every skip and every 4/5-bit logit sat on it, and a latency target skipped layers
    0-6 in index order, held-out KL 8.05, instead of the layers whose measured skip KL is lowest.)"""
    import torch

    s = sens.scale()

    def f(t):
        return -kappa * t / s

    keep = torch.stack([f(sens.skip), torch.zeros_like(sens.skip)], dim=-1)
    out = {"keep": keep, "width": f(sens.width), "bits": f(sens.bits)}
    if sens.head is not None:
        out["head"] = f(sens.head)
    return out


__all__ = ["Sensitivity", "calibrate", "head_kl", "init_logits", "input_moments", "linear_kl", "mean_kl", "measure", "reference_logp", "weighted_error"]
