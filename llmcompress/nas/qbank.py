"""The quantized weights a NAS run searches, scores and ships: one table per (layer, linear, bit width).

Before this module the supernet, the sensitivities and the validated step scored round-to-nearest weights
while the export applied GPTQ, so what was searched was not what was saved. `QuantBank` computes every
linear's quantized weight at every bit width of the space once, with the method the export uses (GPTQ with
Hessians E[x x^T] of the teacher's inputs on the calibration blocks, optional act-order with static groups;
or RTN), and every later step reads it:

* the supernet mixes `dequant(i, j, k)` (recomputed on the fly from the uint8 integers, so memory is one byte
  per weight and bit width instead of four);
* the sensitivity proxy and its calibration measure the error of exactly these weights;
* the export copies `qweight(i, j, k, width)` into the derived model: a narrower MLP takes the first `width`
  rows of gate/up and the first `width` columns (whole groups) of down, which is the same prefix mask the
  supernet applied, so the exported model computes what the search measured.

A 16-bit choice is the original floating weight (not quantized, costed as float16 in cost.py).
The output head (`space.head_bits`, when searched) is stored under layer index `HEAD` (-1), linear 0, one
entry per head bit width; it is round-to-nearest whatever the method (a tied head is also the embedding
table, which GPTQ's objective, the head's output error, does not cover).
GPTQ is hand-wired here only as a loop over the existing `quant.gptq` functions; nothing new is implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcompress.io.adapters import get_adapter

if TYPE_CHECKING:
    import torch

    from llmcompress.nas.space import SearchSpace
    from llmcompress.quant.apply import QuantizedWeight

FLOAT_BITS = 16  # a bit width at or above this keeps the floating weight
HEAD = -1  # bank layer index of the output head (linear index 0, bits index into space.head_bits)
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj", "mlp.up_proj": "mlp.gate_proj"}


@dataclass
class QuantBank:
    """(layer, linear index, bits index) -> integer weight; 16-bit entries point at the float weight."""

    space: SearchSpace
    method: str
    sym8: bool
    act_order: bool
    entries: dict = field(default_factory=dict)  # (i, j, k) -> (q uint8, scale, zero int32, bits, sym)
    floats: dict = field(default_factory=dict)  # (i, j) -> the teacher's weight tensor (shared, not copied)

    def dequant(self, i: int, j: int, k: int, dtype=None) -> torch.Tensor:
        """The weight of linear j of layer i at bits index k, as the model computes with it."""
        import torch

        e = self.entries.get((i, j, k))
        W = self.floats[(i, j)]
        if e is None:
            return W if dtype is None else W.to(dtype)
        q, s, z = e[0], e[1], e[2]
        gs = self.space.group_size
        out, inp = q.shape
        w = (q.reshape(out, inp // gs, gs).float() - z.float()[..., None]) * s[..., None]
        return w.reshape(out, inp).to(dtype or W.dtype or torch.float32)

    def qweight(self, i: int, j: int, k: int, width: int | None = None) -> QuantizedWeight | None:
        """The integer weight (None for a 16-bit choice), sliced to an MLP `width` (rows of gate/up, whole
        groups of columns of down)."""
        import torch

        from llmcompress.quant.apply import QuantizedWeight

        e = self.entries.get((i, j, k))
        if e is None:
            return None
        q, s, z, bits, sym = e
        name = self.space.linears[j] if i != HEAD else "lm_head"
        if width is not None and width < self.space.intermediate:
            if name in ("mlp.gate_proj", "mlp.up_proj"):
                q, s, z = q[:width], s[:width], z[:width]
            elif name == "mlp.down_proj":
                g = width // self.space.group_size
                q, s, z = q[:, :width], s[:, :g], z[:, :g]
        return QuantizedWeight(q.to(torch.int32), s.clone(), z.clone(), bits, self.space.group_size, sym)


def build_bank(model, space: SearchSpace, method: str = "gptq", blocks=None, act_order: bool = True, sym8: bool = False,
               progress: bool = True) -> QuantBank:
    """Quantize every searched linear of `model` at every bit width of `space` (see the module docstring).

    Args:
        model: the teacher, MLP channels already ranked (space.permute_mlp_): the bank is in that order.
        method: gptq (Hessians from `blocks`) or rtn.
        sym8: 8-bit entries symmetric (GGUF's Q8_0).
    """
    import torch

    from llmcompress.progress import track
    from llmcompress.quant import primitives as P

    layers = get_adapter(model).decoder_layers(model)
    bank = QuantBank(space, method, sym8, act_order)
    fqns = {(i, j): space.fqn(i, n) for i in range(space.n_layers) for j, n in enumerate(space.linears)}
    mods = dict(model.named_modules())
    H = None
    if method == "gptq":
        from llmcompress.quant.gptq import gptq_quantize, input_hessians

        if blocks is None:
            raise ValueError("GPTQ needs calibration blocks")
        # linears reading the same input share one Hessian (q/k/v read the attention norm's output, gate/up
        # the MLP norm's): one x^T x per distinct input instead of one per linear
        own = {n: SHARED_INPUT.get(n, n) for n in space.linears}
        H = input_hessians(model, sorted({space.fqn(i, own[n]) for i in range(space.n_layers) for n in space.linears}), blocks)
        H = {fqns[(i, j)]: H[space.fqn(i, own[n])] for i in range(space.n_layers) for j, n in enumerate(space.linears)}
    items = [(i, j) for i in range(len(layers)) for j in range(len(space.linears))]
    for i, j in track(items, f"quantizing every choice ({method.upper()}, {len(space.bits)} bit widths)") if progress else items:
        W = mods[fqns[(i, j)]].weight
        bank.floats[(i, j)] = W.detach()  # shares storage: no copy
        for k, b in enumerate(space.bits):
            if b >= FLOAT_BITS:
                continue
            sym = sym8 and b == 8
            if H is not None:
                q, s, z = gptq_quantize(W.data, H[fqns[(i, j)]], b, space.group_size, act_order=act_order, sym=sym)
            else:
                q, s, z = P.quantize(W.data, b, space.group_size, sym=sym)
            bank.entries[(i, j, k)] = (q.to(torch.uint8), s.float(), z.to(torch.int32), b, sym)
        if H is not None:
            H.pop(fqns[(i, j)], None)
    if space.head_bits:
        W = model.get_output_embeddings().weight
        bank.floats[(HEAD, 0)] = W.detach()
        for k, b in enumerate(space.head_bits):
            if b < FLOAT_BITS:
                sym = sym8 and b == 8
                q, s, z = P.quantize(W.data, b, space.group_size, sym=sym)
                bank.entries[(HEAD, 0, k)] = (q.to(torch.uint8), s.float(), z.to(torch.int32), b, sym)
    return bank


__all__ = ["FLOAT_BITS", "HEAD", "QuantBank", "build_bank"]
