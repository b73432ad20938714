"""Layer-wise curriculum distillation with a cached, prefetched teacher (and an end-to-end baseline).

    from llmcompress.distill import DistillConfig, distill
    result = distill(DistillConfig(teacher="smollm2-135m", keep_layers=15, train_tokens=16384), "out/")

Importing this package is cheap; torch loads when `distill` runs.
"""

from __future__ import annotations

from llmcompress.distill.config import (
    CacheDtype,
    DistillConfig,
    HiddenLoss,
    Mode,
    Precision,
    Select,
    config_from_dict,
    load_spec,
)

__all__ = ["CacheDtype", "DistillConfig", "HiddenLoss", "Mode", "Precision", "Select", "config_from_dict", "distill", "DistillResult", "load_spec"]


def __getattr__(name: str):
    if name in ("distill", "DistillResult"):
        from llmcompress.distill import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'llmcompress.distill' has no attribute {name!r}")
