"""Activation compression: linear layers save a random sketch of their input instead of the input.

`with compress_activations(model, rank=...) as ac:` around any training loop (see layer.py for what is
exact and what is estimated, sketch.py for the math, counter.py for the saved-bytes count, optim.py for the
co-compressed optimizer step, loss.py for the cross-entropy that never materialises the logits).
"""

from __future__ import annotations

__all__ = ["compress_activations", "linear", "count_saved", "FactoredStep", "chunked_cross_entropy", "causal_lm_loss"]


def __getattr__(name: str):  # torch is imported on first use, so `import llmcompress` stays fast
    if name in ("compress_activations", "linear", "ActCompressor"):
        from llmcompress.actcomp import layer as _lin

        return getattr(_lin, name)
    if name == "FactoredStep":
        from llmcompress.actcomp.optim import FactoredStep

        return FactoredStep
    if name in ("chunked_cross_entropy", "causal_lm_loss"):
        from llmcompress.actcomp import loss as _loss

        return getattr(_loss, name)
    if name == "count_saved":
        from llmcompress.actcomp.counter import count_saved

        return count_saved
    raise AttributeError(name)
