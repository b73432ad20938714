"""Save a checkpoint that plain `transformers` loads: safetensors, tokenizer, and an llmcompress manifest.

The manifest `llmcompress.json` records the llmcompress version, the source model and a hash of its
weights, the method with its full config, and measured metrics. The write is atomic: files go to a
temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import platform
import time
from pathlib import Path
from typing import Any

from llmcompress import __version__
from llmcompress.io.atomic import atomic_dir, write_json

MANIFEST = "llmcompress.json"


def weights_hash(model) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes (state-dict order)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def build_manifest(
    *,
    source: str,
    source_hash: str,
    method: str,
    config: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "llmcompress_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source_model": {"spec": source, "weights_sha256": source_hash},
        "method": method,
        "config": config or {},
        "metrics": metrics or {},
        **(extra or {}),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
    }


def _cast_state(model, dtype) -> dict:
    """The model's state dict with floating tensors in `dtype` (tied tensors stay shared)."""
    memo: dict = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key not in memo:
            memo[key] = t.detach().to(dtype) if t.is_floating_point() else t
        out[name] = memo[key]
    return out


def save_checkpoint(
    model,
    tokenizer,
    out: Path,
    *,
    manifest: dict[str, Any],
    overwrite: bool = False,
    dtype: str | None = None,
) -> Path:
    """Write model (safetensors), tokenizer and manifest to `out`, atomically.

    dtype: float32 | bfloat16 | float16 to save the floating tensors in (the model itself is not changed);
    None saves them as they are. Engines pass the source model's dtype (io/dtypes.py) or --save-dtype.
    The manifest states `dtype`, `parameters` and `bytes_on_disk` (the safetensors files).
    """
    out = Path(out)
    from llmcompress.io.dtypes import dtype_name, torch_dtype
    from llmcompress.io.load import _drop_quantization_config, quiet_transformers

    quiet_transformers()
    _drop_quantization_config(model)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        if dtype is None:
            model.save_pretrained(tmp, safe_serialization=True)
            dtype = dtype_name(next(model.parameters()).dtype)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=_cast_state(model, torch_dtype(dtype)))
            _set_config_dtype(tmp / "config.json", dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = dict(manifest)
        manifest.setdefault("layers", model.config.num_hidden_layers)
        manifest.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        manifest["dtype"] = dtype
        manifest["bytes_on_disk"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        manifest["weights_sha256"] = weights_hash(model)
        write_json(tmp / MANIFEST, manifest)
        tmp.chmod(0o755)
    return out


def _set_config_dtype(path: Path, dtype: str) -> None:
    import json

    cfg = json.loads(path.read_text())
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    write_json(path, cfg)
