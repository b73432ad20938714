"""Source dtype of a model and the dtype its outputs are saved in.

Every engine saves in the dtype the source model is distributed in, whatever dtype it computed in:
bfloat16 for a GGUF source such as `smollm2-135m` (its weights are dequantized from Q4_1; the model was
trained and published in bfloat16), the `dtype` / `torch_dtype` of an HF directory's config.json
(float32 when absent). `--save-dtype` overrides.
"""

from __future__ import annotations

import json
from pathlib import Path

SAVE_DTYPES = ("float32", "bfloat16", "float16")
GGUF_SOURCE_DTYPE = "bfloat16"


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; 'float32' for None."""
    if dtype is None:
        return "float32"
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str):
    import torch

    from llmcompress.errors import UserError

    if name not in SAVE_DTYPES:
        raise UserError(f"unknown save dtype {name!r}", f"use one of {', '.join(SAVE_DTYPES)}")
    return getattr(torch, name)


def config_dtype(config: dict) -> str:
    """The dtype an HF config.json declares (float32 when it declares none we save in)."""
    d = config.get("dtype") or config.get("torch_dtype")
    d = dtype_name(d) if d else "float32"
    return d if d in SAVE_DTYPES else "float32"


def detect_source_dtype(kind: str, where) -> str:
    """Source dtype from load.resolve()'s (kind, location)."""
    if kind in ("alias", "gguf"):
        return GGUF_SOURCE_DTYPE
    if kind == "hub":
        try:
            from transformers import AutoConfig

            return config_dtype(AutoConfig.from_pretrained(str(where)).to_dict())
        except (OSError, ValueError):
            return "float32"
    cfg = Path(where) / "config.json"
    try:
        return config_dtype(json.loads(cfg.read_text())) if cfg.is_file() else "float32"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "float32"


def source_dtype_of(lm) -> str:
    """The source dtype of a LoadedModel (float32 for objects that do not know it)."""
    return getattr(lm, "source_dtype", None) or "float32"


def save_dtype_for(lm, override: str | None = None) -> str:
    """--save-dtype when given, else the source's dtype."""
    if override is not None:
        torch_dtype(override)  # validates
        return override
    return source_dtype_of(lm)
