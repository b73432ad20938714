"""Exact count of the bytes the autograd graph holds for backward, taken in the saved-tensor pack path.

Every tensor autograd saves goes through `torch.autograd.graph.saved_tensors_hooks`' pack function; the
counter records its storage there (a storage saved twice, or saved as several views, is counted once:
that is what the graph holds) and returns the tensor unchanged, so training is not altered. Storages of
parameters are not counted (they exist anyway). Each saved storage is put in one category:

* linear_input: saved inside an `nn.Linear` forward of a decoder layer with the input's token count as leading size (its
  input, autocast's copy of it, or its sketch under compression);
* weight_copy: anything else saved inside a decoder layer's `nn.Linear` forward with the weight's element count
  (autocast's bf16 copy of the weight, saved transposed);
* decoder_other: saved inside a decoder layer, outside its linears (norms, attention, activations);
* outside: everything else (embeddings, final norm, head and its weight copy, logits, softmax and loss).

`reset()` starts a new step; `peak` keeps each category's largest per-step value.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

CATEGORIES = ("linear_input", "weight_copy", "decoder_other", "outside")


@dataclass
class SavedBytes:
    """Bytes held for backward in the current step (`step`) and the largest step so far (`peak`)."""

    step: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    uncompressed_linear_input: int = 0  # what the sketched inputs would have held (set by ActCompressor)
    peak_uncompressed_linear_input: int = 0
    _seen: dict = field(default_factory=dict)
    _params: set = field(default_factory=set)
    _linear: list = field(default_factory=list)  # stack of in-flight Linear modules
    _decoder: int = 0
    _peak_totals: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.step.values())

    @property
    def peak_total(self) -> int:
        return max(self._peak_totals) if self._peak_totals else self.total

    def decoder_layers(self) -> int:
        return self.step["linear_input"] + self.step["weight_copy"] + self.step["decoder_other"]

    def reset(self) -> None:
        """Close the current step (its totals go into `peak`) and start counting a new one."""
        self._close()
        self.step = dict.fromkeys(CATEGORIES, 0)
        self.uncompressed_linear_input = 0
        self._seen = {}

    def _close(self) -> None:
        if self.total:
            self._peak_totals.append(self.total)
        for k, v in self.step.items():
            self.peak[k] = max(self.peak[k], v)
        self.peak_uncompressed_linear_input = max(self.peak_uncompressed_linear_input, self.uncompressed_linear_input)

    def summary(self) -> dict[str, int]:
        """Peak per-step bytes by category, their total, and the linear inputs' uncompressed bytes."""
        self._close()
        out = {f"saved_{k}_bytes": v for k, v in self.peak.items()}
        out["saved_total_bytes"] = self.peak_total
        out["saved_linear_input_uncompressed_bytes"] = self.peak_uncompressed_linear_input or self.peak["linear_input"]
        return out

    def holds(self, t) -> bool:
        """Whether `t`'s storage is already saved for backward in this step."""
        return (t.untyped_storage().data_ptr(), t.device) in self._seen

    # ---- pack path -----------------------------------------------------------------------------

    def pack(self, t):
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key[0] == 0 or key in self._seen or st.data_ptr() in self._params:
            return t
        if self._linear and self._decoder:
            mod, lead = self._linear[-1]
            input_like = t.dim() >= 2 and t.is_contiguous() and t.numel() // max(1, t.shape[-1]) == lead
            kind = "weight_copy" if not input_like and t.numel() == mod.weight.numel() else "linear_input"
        elif self._decoder:
            kind = "decoder_other"
        else:
            kind = "outside"
        self._seen[key] = kind
        self.step[kind] += st.nbytes()
        return t


def _linears(modules):
    import torch.nn as nn

    return [m for root in modules for m in root.modules() if isinstance(m, nn.Linear)]


@contextmanager
def count_saved(modules, decoder_layers=(), params=None):
    """Count saved-for-backward bytes of everything run inside (see the module docstring).

    Args:
        modules: modules whose `nn.Linear`s are tracked (a model, or a list of layers).
        decoder_layers: modules whose forwards count as "decoder" (the rest is "outside").
        params: tensors whose storages are not counted (default: the parameters of `modules`).
    """
    import torch

    c = SavedBytes()
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    c._params = {p.untyped_storage().data_ptr() for p in (params if params is not None else (q for m in modules for q in m.parameters()))}
    handles = []

    def lin_pre(mod, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        c._linear.append((mod, x.numel() // max(1, x.shape[-1]) if x is not None and x.dim() else 0))  # the input's token count

    def lin_post(mod, args, out):
        if c._linear and c._linear[-1][0] is mod:
            c._linear.pop()

    def dec_pre(mod, args, kwargs=None):
        c._decoder += 1

    def dec_post(mod, args, out):
        c._decoder = max(0, c._decoder - 1)

    for lin in _linears(modules):
        handles += [lin.register_forward_pre_hook(lin_pre, with_kwargs=True), lin.register_forward_hook(lin_post)]
    for layer in decoder_layers:
        handles += [layer.register_forward_pre_hook(dec_pre), layer.register_forward_hook(dec_post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
            yield c
    finally:
        for h in handles:
            h.remove()
