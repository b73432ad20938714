"""Save a checkpoint that plain `transformers` loads: safetensors, tokenizer, and an llmcompress manifest.

The manifest `llmcompress.json` records the llmcompress version, the source model and a hash of its
weights, the method with its full config, and measured metrics, and the sha256 of every other file of the
checkpoint (`files_sha256`), which `llmcompress verify` checks: safetensors has no checksum of its own, so
bit flips in tensor data would otherwise load silently. The write is atomic: files go to a temporary
directory that is renamed into place only when complete.
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
DIGESTS = "files_sha256"


def _sha256(path: Path) -> str:
    from llmcompress.io.load import sha256_file

    return sha256_file(path)


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` but the manifest (which records these digests), by file name."""
    return {p.name: _sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}


def verify_checkpoint(folder: Path) -> dict[str, int]:
    """Compare every file of a checkpoint with the digest its manifest recorded. Raises UserError naming the
    files that differ or are missing; returns {"files": n, "bytes": total} when all match."""
    import json

    from llmcompress.errors import UserError

    folder = Path(folder)
    m = folder / MANIFEST
    if not m.is_file():
        raise UserError(f"{folder} has no {MANIFEST}", "verify checks checkpoints written by llmcompress")
    try:
        digests = json.loads(m.read_text()).get(DIGESTS)
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise UserError(f"{m} is not valid JSON", "re-create the checkpoint") from None
    if not isinstance(digests, dict) or not digests:
        raise UserError(f"{m} records no file digests (written by an older llmcompress)", "re-create the checkpoint to verify it")
    bad, missing, total = [], [], 0
    for name, want in sorted(digests.items()):
        p = folder / str(name)
        if "/" in str(name) or not p.is_file():
            missing.append(str(name))
            continue
        total += p.stat().st_size
        if _sha256(p) != want:
            bad.append(str(name))
    if bad or missing:
        what = "; ".join(x for x in (f"changed: {', '.join(bad)}" if bad else "", f"missing: {', '.join(missing)}" if missing else "") if x)
        raise UserError(f"{folder} does not match the digests in its {MANIFEST} ({what})", "re-create or re-download the checkpoint")
    return {"files": len(digests), "bytes": total}


def weights_hash(model) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes (state-dict order)."""
    from llmcompress.metrics import update_tensor_digest

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        update_tensor_digest(h, t, label=f"{name}:")
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
    """Write model (safetensors), tokenizer, manifest, model card (README.md) and recipe.yaml to `out`, atomically.

    dtype: float32 | bfloat16 | float16 to save the floating tensors in (the model itself is not changed);
    None saves them as they are. Engines pass the source model's dtype (io/dtypes.py) or --save-dtype.
    The manifest states `dtype`, `parameters` and `bytes_on_disk` (the safetensors files).
    """
    out = Path(out)
    from llmcompress.io.dtypes import dtype_name, torch_dtype
    from llmcompress.io.load import drop_quantization_config, quiet_transformers

    quiet_transformers()
    drop_quantization_config(model)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        if dtype is None:
            model.save_pretrained(tmp, safe_serialization=True)
            dtype = dtype_name(next(model.parameters()).dtype)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=_cast_state(model, torch_dtype(dtype)))
            set_config_dtype(tmp / "config.json", dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        finish_checkpoint(tmp, manifest, name=out.name, layers=model.config.num_hidden_layers,
                          parameters=sum(p.numel() for p in model.parameters()), dtype=dtype, weights_sha256=weights_hash(model))
    return out


def finish_checkpoint(tmp: Path, manifest: dict[str, Any], *, name: str, layers: int, parameters: int, dtype: str,
                      weights_sha256: str) -> None:
    """The manifest's closing fields (layers, parameters, dtype, bytes on disk, weights hash), the model card
    and the file digests, written into the checkpoint folder `tmp` whose weights, config and tokenizer are
    already there (`save_checkpoint`, and writers that stream the weights layer by layer)."""
    from llmcompress.io.card import write_card

    manifest = dict(manifest)
    manifest.setdefault("layers", layers)
    manifest.setdefault("parameters", parameters)
    manifest["dtype"] = dtype
    manifest["bytes_on_disk"] = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
    manifest["weights_sha256"] = weights_sha256
    write_card(tmp, manifest, name=name)  # README.md model card + recipe.yaml, covered by the digests
    manifest[DIGESTS] = file_digests(tmp)
    write_json(Path(tmp) / MANIFEST, manifest)


def set_config_dtype(path: Path, dtype: str) -> None:
    import json

    cfg = json.loads(path.read_text())
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    write_json(path, cfg)
