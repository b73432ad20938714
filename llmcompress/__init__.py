"""llmcompress: make pretrained causal LLMs smaller and faster, and prove it with measurements.

Importing this package is cheap: torch and transformers load only when a function that needs them
is called. The public entry points are re-exported lazily below.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load_model": "llmcompress.io.load",
    "save_checkpoint": "llmcompress.io.checkpoint",
    "get_adapter": "llmcompress.io.adapters",
    "keep_layers": "llmcompress.io.surgery",
    "remove_layers": "llmcompress.io.surgery",
    "replace_layers": "llmcompress.io.surgery",
    "UserError": "llmcompress.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmcompress' has no attribute {name!r}")
