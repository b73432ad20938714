"""Activation compression: linear layers save a random sketch of their input instead of the input.

`with compress_activations(model, rank=...) as ac:` around any training loop (see layer.py for what is
exact and what is estimated, sketch.py for the math, counter.py for the saved-bytes count).
"""

from __future__ import annotations

__all__ = ["compress_activations", "linear", "count_saved"]


def __getattr__(name: str):  # torch is imported on first use, so `import llmcompress` stays fast
    if name in ("compress_activations", "linear", "ActCompressor"):
        from llmcompress.actcomp import layer as _lin

        return getattr(_lin, name)
    if name == "count_saved":
        from llmcompress.actcomp.counter import count_saved

        return count_saved
    raise AttributeError(name)
