"""A supernet over the teacher's own (frozen) weights: Gumbel-softmax mixtures of the choices.

* bits: each linear's weight becomes sum_b g_b * Q_b(W), where Q_b(W) is the weight the export ships at b
  bits (nas/qbank.py: GPTQ or RTN, computed once; the weights are shared with the teacher and frozen, so
  Q_b(W) does not change; mixing weights is exact for a linear map and costs one matmul instead of one per
  choice). The mixture is recomputed from the bank's uint8 integers in forward and backward (`_Mix`),
  so no float copy of every bit width is held.
* width: the input of `down_proj` is multiplied by sum_k g_k * prefix_mask_k (channels are ranked, so
  width k keeps the first widths[k] channels).
* skip: the layer output becomes h + g_keep * (layer(h) - h).
* head (when `space.head_bits` is searched): the output head's weight is sum_h g_h * Q_h(W_head) (bank layer
  HEAD); a tied head is the embedding table too, so the input embedding looks up the same mixed weight.

With `teacher()` active the patched modules run the original weights: one model serves as teacher and
student. Only the architecture logits are trained.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmcompress.io.adapters import get_adapter
from llmcompress.nas.qbank import HEAD, QuantBank, build_bank
from llmcompress.nas.space import Arch, SearchSpace


class _Mix(torch.autograd.Function):
    """W = sum_k g_k * bank.dequant(i, j, k), without keeping the dequantized weights for backward."""

    @staticmethod
    def forward(ctx, g, bank, i, j):
        ctx.bank, ctx.i, ctx.j = bank, i, j
        ctx.save_for_backward(g)
        W = None
        for k in range(g.shape[0]):
            if float(g[k]) < 1e-12:  # a one-hot sample is exact; a soft one loses < 1e-12 of a weight
                continue
            t = g[k] * bank.dequant(i, j, k)
            W = t if W is None else W + t
        return W

    @staticmethod
    def backward(ctx, gW):
        (g,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.stack([(gW * ctx.bank.dequant(ctx.i, ctx.j, k)).sum() for k in range(g.shape[0])]).to(g.dtype)
        return grad, None, None, None


def one_hot_logits(n: int, idx: int, scale: float = 30.0) -> torch.Tensor:
    t = torch.full((n,), -scale)
    t[idx] = scale
    return t


class Supernet(nn.Module):
    """Architecture logits plus the hooks that make `model` compute the sampled mixture.

    Args:
        model: the teacher (its MLP channels already ranked; see space.permute_mlp_).
        space: the search space.
        bank: the quantized weights (nas/qbank.py); default: RTN of `model` (tests).
        learn: which logit groups are trained ({"keep", "width", "bits"}); others stay as initialised.
    """

    def __init__(self, model, space: SearchSpace, bank: QuantBank | None = None, learn: set[str] | None = None) -> None:
        super().__init__()
        L, nl, nb, K = space.n_layers, len(space.linears), len(space.bits), len(space.widths)
        self.groups = ("keep", "width", "bits", "head") if space.head_bits else ("keep", "width", "bits")
        self.space, self.learn = space, set(learn or self.groups)
        self.keep = nn.Parameter(torch.tensor([[0.0, 3.0]]).repeat(L, 1))  # start near "keep"
        self.width = nn.Parameter(torch.zeros(L, K))
        self.bits = nn.Parameter(torch.zeros(L, nl, nb))
        if space.head_bits:
            self.head = nn.Parameter(torch.zeros(len(space.head_bits)))
        self._model = [model]  # not a submodule: its weights are not ours
        self._handles: list = []
        self.bank = bank if bank is not None else build_bank(model, space, "rtn", progress=False)
        self._sample: dict[str, torch.Tensor] | None = None
        self.active = False
        self._prepare()

    # ---- setup -------------------------------------------------------------------------------------

    def _prepare(self) -> None:
        s = self.space
        widths = torch.tensor(s.widths)
        self.register_buffer("masks", (torch.arange(s.intermediate)[None, :] < widths[:, None]).float(), persistent=False)

    def fix(self, arch: Arch, groups: set[str]) -> None:
        """Pin the named logit groups to `arch`'s choices (and stop learning them)."""
        s = self.space
        with torch.no_grad():
            for i in range(s.n_layers):
                if "keep" in groups:
                    self.keep[i] = one_hot_logits(2, int(arch.keep[i]))
                if "width" in groups:
                    self.width[i] = one_hot_logits(len(s.widths), arch.width[i])
                if "bits" in groups:
                    for j in range(len(s.linears)):
                        self.bits[i, j] = one_hot_logits(len(s.bits), arch.bits[i][j])
            if "head" in groups and s.head_bits and arch.head is not None:
                self.head.copy_(one_hot_logits(len(s.head_bits), arch.head))
        self.learn -= groups

    def init_from(self, logits: dict[str, torch.Tensor], groups: set[str] | None = None) -> None:
        """Set the named logit groups (default: all) to `logits` (e.g. sensitivity.init_logits)."""
        with torch.no_grad():
            for g in groups or self.groups:
                if g in self.groups and g in logits:
                    getattr(self, g).copy_(logits[g])

    def trainable(self) -> list[nn.Parameter]:
        return [getattr(self, g) for g in self.groups if g in self.learn]

    # ---- hooks -------------------------------------------------------------------------------------

    def install(self) -> None:
        model, s = self._model[0], self.space
        layers = get_adapter(model).decoder_layers(model)
        for i, layer in enumerate(layers):
            mods = dict(layer.named_modules())
            for j, name in enumerate(s.linears):
                lin = mods[name]
                lin.forward = self._linear_forward(lin, i, j)
                self._handles.append(("forward", lin))
            self._handles.append(layer.mlp.down_proj.register_forward_pre_hook(self._width_hook(i)))
            if s.allow_skip:
                self._handles.append(layer.register_forward_hook(self._skip_hook(i), with_kwargs=True))
        if s.head_bits:
            head = model.get_output_embeddings()
            head.forward = self._head_forward(head)
            self._handles.append(("forward", head))
            if s.tied:
                emb = model.get_input_embeddings()
                emb.forward = self._embed_forward(emb)
                self._handles.append(("forward", emb))

    def remove(self) -> None:
        for h in self._handles:
            if isinstance(h, tuple):
                del h[1].forward  # back to the class's forward
            else:
                h.remove()
        self._handles = []

    def _linear_forward(self, lin: nn.Linear, i: int, j: int):
        # F.linear, or the compressed linear inside compress_activations (--act-rank)
        from llmcompress.actcomp import linear

        def forward(x):
            if not self.active:
                return F.linear(x, lin.weight, lin.bias)
            g = self._sample["bits"][i, j]  # (nb,)
            W = _Mix.apply(g, self.bank, i, j)
            return linear(lin, x, W, lin.bias)

        return forward

    def _head_weight(self):
        return _Mix.apply(self._sample["head"], self.bank, HEAD, 0)

    def _head_forward(self, lin: nn.Linear):
        def forward(x):
            return F.linear(x, self._head_weight() if self.active else lin.weight, lin.bias)

        return forward

    def _embed_forward(self, emb: nn.Embedding):
        def forward(ids):
            if not self.active:
                return F.embedding(ids, emb.weight, emb.padding_idx)
            return F.embedding(ids, self._head_weight(), emb.padding_idx)

        return forward

    def _width_hook(self, i: int):
        def pre(mod, args):
            if not self.active:
                return None
            m = self._sample["width"][i] @ self.masks  # (I,)
            return (args[0] * m,)

        return pre

    def _skip_hook(self, i: int):
        def post(mod, args, kwargs, out):
            if not self.active:
                return None
            h = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            g = self._sample["keep"][i, 1]
            y = h + g * (y - h)
            return (y, *out[1:]) if isinstance(out, tuple) else y

        return post

    # ---- sampling ----------------------------------------------------------------------------------

    def probs(self) -> dict[str, torch.Tensor]:
        return {g: getattr(self, g).softmax(-1) for g in self.groups}

    def sample(self, tau: float, generator: torch.Generator | None = None) -> None:
        """Draw one Gumbel-softmax relaxation of every choice (used by the next student forwards)."""

        def gs(logits):
            u = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9)
            return ((logits - torch.log(-torch.log(u))) / tau).softmax(-1)

        self._sample = {g: (gs(getattr(self, g)) if g in self.learn else getattr(self, g).softmax(-1)) for g in self.groups}

    def logits(self) -> dict[str, torch.Tensor]:
        return {g: getattr(self, g).detach().clone() for g in self.groups}

    @contextmanager
    def student(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    @contextmanager
    def pinned(self, arch: Arch):
        """The model computes exactly `arch` with the bank's weights (every group pinned: keep, width, bits and,
        when searched, the head; one-hot, exact to e^-60), i.e. what the export ships; logits, learned groups
        and the model's own weights are restored on exit."""
        saved, learn = self.logits(), set(self.learn)
        self.fix(arch, set(self.groups))
        self.sample(1.0)
        self.install()
        try:
            with self.student():
                yield
        finally:
            self.remove()
            self.init_from(saved)
            self.learn = learn
