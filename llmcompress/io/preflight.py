"""Checks before the work: every place a run will write (--out, the cache) is writable and has room.

A run that computes for an hour and then finds its --out unwritable loses the hour, so each command
calls `check_writable` on its output and cache directories before any model loads, with a rough
estimate of what it will write there (from the sizes of the model's files on disk). Writability is
tested by creating a file, not with os.access: root passes every permission check, but not a read-only
mount or a pseudo file system like /proc.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from llmcompress.errors import UserError

MB = 1e6


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: Path, need_bytes: float = 0, what: str = "--out") -> None:
    """Raise UserError (exit 2) unless files can be created at `path` (a directory, made if missing) and its
    file system has `need_bytes` free. Creates nothing that stays: a probe file is made and removed."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} exists and is not a directory", f"choose another {what}")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UserError(f"{what} {path} cannot be created: {base} is a file, not a directory", f"choose another {what}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".llmcompress-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{what} {path} is not writable: cannot create files in {base} ({exc.strerror or exc})", f"choose a writable {what}") from None
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise UserError(
            f"not enough space for {what} {path}: needs ~{need_bytes / MB:,.0f} MB, {free / MB:,.0f} MB free on {base}",
            f"free some space or choose another {what}",
        )


def dir_bytes(path: Path, pattern: str = "*") -> int:
    """Total size of the files matching `pattern` directly in `path` (0 when it is not a directory)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file()) if path.is_dir() else 0


def model_bytes(spec: str) -> tuple[int, int]:
    """(bytes of the model's float checkpoint, bytes its first load adds to the cache), both estimates.

    A GGUF (or alias) is dequantized to float32 into the cache on its first load: about 4x the file for
    8-bit weights, the dominant case; once converted, the cached folder's size is exact. Hub ids: unknown (0).
    """
    from llmcompress.io import load

    kind, where = load.resolve(spec)
    if kind in ("alias", "gguf"):
        gguf = load.alias_gguf_path(load.ALIASES[where]) if kind == "alias" else Path(where)
        cached = load.gguf_cache_dir(gguf)
        if (cached / "config.json").is_file():
            return dir_bytes(cached, "*.safetensors"), 0
        size = 4 * gguf.stat().st_size
        return size, size
    if kind in ("dir", "zipped", "packed"):
        return dir_bytes(Path(where)), 0
    return 0, 0


def model_config(spec: str) -> dict:
    """The model's config.json when it is on disk (a directory, or a converted GGUF in the cache), else {}."""
    import json

    from llmcompress.io import load

    kind, where = load.resolve(spec)
    if kind in ("alias", "gguf"):
        where = load.gguf_cache_dir(load.alias_gguf_path(load.ALIASES[where]) if kind == "alias" else Path(where))
    path = Path(where) / "config.json" if kind != "hub" else None
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}


def check_run_outputs(out: Path | None, models: Sequence[str] = (), *, out_factor: float = 0.0, out_extra: float = 0.0,
                      cache_extra: float = 0.0, uses_cache: bool = True) -> None:
    """The checks a command runs before loading a model: --out gets `out_factor` x the (largest) model's
    bytes plus `out_extra`; the llmcompress cache, when the run writes there (converted models, token
    caches, distill's teacher features), gets what the models' first loads add plus `cache_extra`. When
    --out and the cache share a file system, the two needs are added."""
    from llmcompress.paths import cache_dir

    sizes = [model_bytes(m) for m in models]
    cache_add = sum(c for _, c in sizes)
    uses_cache = uses_cache or cache_add > 0 or cache_extra > 0
    cache_need = (cache_add + cache_extra + MB) if uses_cache else 0  # token caches are small
    out_need = out_factor * max((s for s, _ in sizes), default=0) + out_extra
    cache = cache_dir()
    if out is not None:
        check_writable(out, out_need + (cache_need if _device(out) == _device(cache) else 0), "--out")
    if uses_cache:
        check_writable(cache, cache_need, "the cache directory (LLMCOMPRESS_CACHE_DIR)")


def _device(path: Path) -> int:
    try:
        return os.stat(_nearest_existing(Path(path).expanduser().absolute())).st_dev
    except OSError:
        return -1
