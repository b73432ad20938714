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


def save_checkpoint(
    model,
    tokenizer,
    out: Path,
    *,
    manifest: dict[str, Any],
    overwrite: bool = False,
) -> Path:
    """Write model (safetensors), tokenizer, manifest, model card (README.md) and recipe.yaml to `out`, atomically."""
    out = Path(out)
    from llmcompress.io.load import _drop_quantization_config, quiet_transformers

    quiet_transformers()
    _drop_quantization_config(model)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = dict(manifest)
        manifest.setdefault("layers", model.config.num_hidden_layers)
        manifest.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        manifest["weights_sha256"] = weights_hash(model)
        write_json(tmp / MANIFEST, manifest)
        from llmcompress.io.card import write_card

        write_card(tmp, manifest, name=out.name)  # README.md model card + recipe.yaml
        tmp.chmod(0o755)
    return out
