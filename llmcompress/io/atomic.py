"""Atomic writes: write to a temporary sibling, then rename, so readers never see half a file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmcompress.errors import OutputExists


def check_out_dir(out: Path, overwrite: bool = False, resume: bool = False) -> None:
    """Refuse an existing, non-empty output directory unless told to overwrite or resume."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output path {out} exists and is not a directory", "choose another --out")
    if out.exists() and any(out.iterdir()) and not (overwrite or resume):
        raise OutputExists(f"output directory {out} already exists", "choose another --out, or pass --overwrite")


@contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `final` only when the block finishes without error."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise OutputExists(f"{final} already exists", "choose another path, or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        trash = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file atomically: a temporary sibling, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def append_jsonl(path: Path, obj) -> None:
    """Append one JSON line and fsync (a crash loses at most the line being written)."""
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
