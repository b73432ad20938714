"""The search space: per decoder layer keep/skip, MLP width (a prefix of importance-ranked channels),
and per linear layer a bit width. Also the discrete `Arch`, its derivation from logits, and a greedy
repair that makes a derived architecture meet every target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcompress.errors import UnsupportedArchitecture, UserError
from llmcompress.io.adapters import get_adapter

if TYPE_CHECKING:
    import torch

ATTN_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = ATTN_LINEARS + MLP_LINEARS


@dataclass
class SearchSpace:
    """Shapes and choices. `shapes[name]` is (out, in) at full width; MLP widths are channel counts."""

    n_layers: int
    hidden: int
    intermediate: int
    widths: list[int]
    bits: list[int]
    group_size: int
    allow_skip: bool
    min_keep: int
    shapes: dict[str, tuple[int, int]]
    layers_path: str = "model.layers"
    linears: tuple[str, ...] = LINEARS
    head_bits: list[int] = field(default_factory=list)  # empty: the head stays float, outside the space
    head_shape: tuple[int, int] = (0, 0)  # (vocab, hidden) of the output head
    tied: bool = False  # the head is the embedding table too

    def shape(self, name: str, width: int) -> tuple[int, int]:
        out, inp = self.shapes[name]
        if name in ("mlp.gate_proj", "mlp.up_proj"):
            return width, inp
        if name == "mlp.down_proj":
            return out, width
        return out, inp

    def fqn(self, layer: int, name: str) -> str:
        return f"{self.layers_path}.{layer}.{name}"


@dataclass
class Arch:
    """A discrete architecture: per original layer keep, MLP width index and bits index per linear, and
    the head's bits index (into space.head_bits; None when the head is not in the space)."""

    keep: list[bool]
    width: list[int]  # index into space.widths
    bits: list[list[int]]  # [layer][linear] index into space.bits
    head: int | None = None
    extra: dict = field(default_factory=dict)

    def copy(self) -> Arch:
        return Arch(list(self.keep), list(self.width), [list(b) for b in self.bits], self.head, dict(self.extra))

    def copy_with_head(self, head: int | None) -> Arch:
        new = self.copy()
        new.head = head
        return new

    def to_dict(self, space: SearchSpace) -> dict:
        layers = []
        for i in range(space.n_layers):
            layers.append({
                "layer": i,
                "keep": self.keep[i],
                "mlp_width": space.widths[self.width[i]],
                "bits": {n: space.bits[b] for n, b in zip(space.linears, self.bits[i])},
            })
        out = {"layers": layers, "kept": sum(self.keep)}
        if self.head is not None:
            out["head_bits"] = space.head_bits[self.head]
        return out

    @classmethod
    def dense(cls, space: SearchSpace, bits_idx: int | None = None) -> Arch:
        """Every layer kept at full width, every linear at bits index `bits_idx` (default: the widest), a
        searched head at the same bit width when it has it."""
        b = len(space.bits) - 1 if bits_idx is None else bits_idx
        n = len(space.linears)
        head = None
        if space.head_bits:  # a searched head at the same width (else the widest below it, else the lowest)
            below = [k for k, hb in enumerate(space.head_bits) if hb <= space.bits[b]]
            head = below[-1] if below else 0
        return cls([True] * space.n_layers, [len(space.widths) - 1] * space.n_layers, [[b] * n for _ in range(space.n_layers)], head)


def _auto_group_size(dims: list[int]) -> int:
    for gs in (128, 64, 32, 16, 8):
        if all(d % gs == 0 for d in dims):
            return gs
    return 0


def build_space(model, cfg) -> SearchSpace:
    """Search space of a llama-family model under `cfg` (NasConfig); raises UserError on bad settings."""
    adapter = get_adapter(model)
    layers = adapter.decoder_layers(model)
    first = layers[0]
    if adapter.family != "llama" or not all(hasattr(first.mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        raise UnsupportedArchitecture(
            f"nas supports llama-family models with gated MLPs, not {model.config.model_type!r}",
            "use a llama, mistral, qwen2 or qwen3 model",
        )
    modules = dict(first.named_modules())
    shapes = {n: tuple(modules[n].weight.shape) for n in LINEARS}
    hidden = model.config.hidden_size
    inter = shapes["mlp.gate_proj"][0]
    widths = sorted({max(1, round(f * inter)) for f in cfg.width_choices})
    in_dims = sorted({s[1] for s in shapes.values()} | set(widths))
    gs = cfg.group_size or _auto_group_size(in_dims)
    if gs == 0:
        raise UserError(f"no group size of 8..128 divides all input widths {in_dims}", "set width_choices to multiples of 8")
    bad = [d for d in in_dims if d % gs]
    if bad:
        ok = _auto_group_size(in_dims)
        raise UserError(
            f"group size {gs} does not divide the width(s) {bad}",
            f"use --group-size {ok}" if ok else "choose other width choices",
        )
    n = len(layers)
    min_keep = max(1, math.ceil(cfg.min_keep_frac * n - 1e-9)) if cfg.allow_skip else n
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return SearchSpace(
        n_layers=n, hidden=hidden, intermediate=inter, widths=widths, bits=sorted(set(cfg.bits)), group_size=gs,
        allow_skip=cfg.allow_skip, min_keep=min(n, min_keep), shapes=shapes, layers_path=adapter.layers,
        head_bits=sorted(set(getattr(cfg, "head_bits", []) or [])), head_shape=tuple(head.shape), tied=tied,
    )


# ---- channel ranking: a narrower MLP is a prefix of a wider one --------------------------------------


def mlp_channel_importance(model, blocks: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, importance of each MLP channel j: E|act(gate_j x) * up_j x| * ||down[:, j]||."""
    import torch

    layers = get_adapter(model).decoder_layers(model)
    sums = [torch.zeros(layer.mlp.down_proj.in_features) for layer in layers]
    hooks = []
    for i, layer in enumerate(layers):
        def pre(mod, args, i=i):
            sums[i] += args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).sum(0).cpu()
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            for b in blocks.split(2):
                model(input_ids=b, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [s * layer.mlp.down_proj.weight.detach().float().norm(dim=0).cpu() for s, layer in zip(sums, layers)]


def permute_mlp_(model, orders: list[torch.Tensor]) -> None:
    """Reorder MLP channels (most important first) in place; the model's outputs are unchanged."""
    import torch

    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad():
        for layer, order in zip(layers, orders):
            mlp = layer.mlp
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight.copy_(lin.weight[order])
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias[order])
            mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, order])


# ---- derivation and repair ---------------------------------------------------------------------------


def argmax_arch(space: SearchSpace, logits: dict[str, torch.Tensor]) -> Arch:
    """The most likely choice everywhere (keeping at least `space.min_keep` layers)."""
    keep_logit = logits["keep"][:, 1] - logits["keep"][:, 0]
    keep = [bool(v > 0) for v in keep_logit] if space.allow_skip else [True] * space.n_layers
    if sum(keep) < space.min_keep:
        order = keep_logit.argsort(descending=True).tolist()
        keep = [False] * space.n_layers
        for i in order[: space.min_keep]:
            keep[i] = True
    width = logits["width"].argmax(-1).tolist()
    bits = logits["bits"].argmax(-1).tolist()
    head = int(logits["head"].argmax()) if space.head_bits and "head" in logits else (len(space.head_bits) - 1 if space.head_bits else None)
    return Arch(keep, width, bits, head)


def violation(metrics: dict[str, float], targets: dict[str, float]) -> float:
    return sum(max(0.0, metrics[k] / t - 1.0) for k, t in targets.items())


def repair(space: SearchSpace, arch: Arch, logits: dict[str, torch.Tensor] | None, costs, targets: dict[str, float],
           kinds: set[str] | None = None) -> Arch:
    """Greedily lower choices until every target holds, each step taking the move with the least loss of
    logit per unit of violation removed (the search's preferences decide what goes first). `kinds` limits
    the moves ("skip", "width", "bits", "head"; default all): a stage whose architecture is fixed repairs bits only
    (with all kinds, skipping a high-bit layer lowers the *average* bits, and pinned logits make it cheap)."""
    arch = arch.copy()
    v = violation(costs.metrics(arch), targets)
    while v > 1e-9:
        best = None
        for move in down_moves(space, arch, kinds):
            new = apply_move(arch, move)
            dv = v - violation(costs.metrics(new), targets)
            if dv <= 1e-12:
                continue
            score = _logit_drop(logits, arch, move) / dv
            if best is None or score < best[0]:
                best = (score, new, dv)
        if best is None:
            raise UserError(f"the search space cannot reach the targets {targets}", "relax a target")
        arch, v = best[1], v - best[2]
    return arch


def upgrade(space: SearchSpace, arch: Arch, logits: dict[str, torch.Tensor] | None, costs, targets: dict[str, float],
            kinds: set[str] | None = None) -> Arch:
    """Greedily raise choices while every target still holds: spends the budget that argmax and repair
    left unused, each step taking the move with the most logit gained per unit of (normalized) cost
    (`kinds` as in `repair`)."""
    arch = arch.copy()
    m = costs.metrics(arch)
    if violation(m, targets) > 1e-9:
        return arch
    while True:
        best = None
        for move in up_moves(space, arch, kinds):
            new = apply_move(arch, move, +1)
            m2 = costs.metrics(new)
            if violation(m2, targets) > 1e-9:
                continue
            dc = sum((m2[k] - m[k]) / t for k, t in targets.items())
            gain = _logit_drop(logits, new, move)  # logit of the raised choice minus the current one
            score = gain / max(dc, 1e-12)
            if gain > 0 and (best is None or score > best[0]):
                best = (score, new, m2)
        if best is None:
            return arch
        arch, m = best[1], best[2]


def up_moves(space: SearchSpace, arch: Arch, kinds: set[str] | None = None):
    """Every single choice that can be raised one step (a skipped layer back on), as (kind, layer, linear);
    only those of `kinds` when given."""
    moves = _up_moves(space, arch)
    return moves if kinds is None else (m for m in moves if m[0] in kinds)


def _up_moves(space: SearchSpace, arch: Arch):
    if arch.head is not None and arch.head < len(space.head_bits) - 1:
        yield ("head", None, None)
    for i in range(space.n_layers):
        if not arch.keep[i]:
            if space.allow_skip:
                yield ("skip", i, None)
            continue
        if arch.width[i] < len(space.widths) - 1:
            yield ("width", i, None)
        for j, b in enumerate(arch.bits[i]):
            if b < len(space.bits) - 1:
                yield ("bits", i, j)


def down_moves(space: SearchSpace, arch: Arch, kinds: set[str] | None = None):
    """Every single choice that can be lowered one step (a kept layer skipped), as (kind, layer, linear);
    only those of `kinds` when given."""
    moves = _down_moves(space, arch)
    return moves if kinds is None else (m for m in moves if m[0] in kinds)


def _down_moves(space: SearchSpace, arch: Arch):
    if arch.head is not None and arch.head > 0:
        yield ("head", None, None)
    kept = sum(arch.keep)
    for i in range(space.n_layers):
        if not arch.keep[i]:
            continue
        if space.allow_skip and kept > space.min_keep:
            yield ("skip", i, None)
        if arch.width[i] > 0:
            yield ("width", i, None)
        for j, b in enumerate(arch.bits[i]):
            if b > 0:
                yield ("bits", i, j)


def apply_move(arch: Arch, move, step: int = -1) -> Arch:
    """Lower (step -1) or raise (+1) one choice; "skip" toggles the layer off (-1) or back on (+1)."""
    kind, i, j = move
    new = arch.copy()
    if kind == "skip":
        new.keep[i] = step > 0
    elif kind == "head":
        new.head += step
    elif kind == "width":
        new.width[i] += step
    else:
        new.bits[i][j] += step
    return new


def _logit_drop(logits, arch: Arch, move) -> float:
    if logits is None:
        return 1.0
    kind, i, j = move
    if kind == "skip":
        k = logits["keep"][i]
        return float(k[1] - k[0])
    if kind == "head":
        h = logits["head"]
        return float(h[arch.head] - h[arch.head - 1])
    if kind == "width":
        w = logits["width"][i]
        return float(w[arch.width[i]] - w[arch.width[i] - 1])
    b = logits["bits"][i, j]
    return float(b[arch.bits[i][j]] - b[arch.bits[i][j] - 1])
