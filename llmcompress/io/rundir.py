"""Run directories, shared by every engine: claim `--out`, tell whether a saved run is the same run, clean
the files a fresh run must not find, and save resumable state as JSON + safetensors (never a pickle).

An engine declares once which files in its output directory belong to a run's progress (`stale`: glob
patterns relative to `--out`); `claim` then refuses an existing directory unless told to overwrite or
resume, and on `--overwrite` (without `--resume`) removes exactly those, so a new run never resumes from,
or appends to, an old run's files. `fingerprint` hashes the settings that decide a run's result (each
config says which fields do not); a resumed run must match the saved one.

`save_state`/`load_state` write a nested state (dicts, lists, numbers, strings, tensors; optimizer state
dicts with integer keys included) as `NAME.json` plus `NAME.safetensors` for its tensors, both atomically,
the JSON last so that it names only tensors already on disk. Hand-written because safetensors holds flat
tensor maps only and JSON no tensors; torch.save would need a pickle, which a shared output directory must
not be asked to unpickle.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcompress.io.atomic import atomic_path, check_out_dir, write_json


def fingerprint(settings: dict[str, Any], skip: Iterable[str] = ()) -> str:
    """16 hex digits of sha256 over the canonical JSON of `settings` without the keys in `skip`.

    Two runs with the same fingerprint compute the same result; `skip` names the fields that do not change
    it (evaluation sizes, output choices, placement).
    """
    skip = set(skip)
    d = {k: v for k, v in settings.items() if k not in skip}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def stale_files(out: Path, stale: Iterable[str]) -> list[Path]:
    """The files and folders of `out` matching the glob patterns `stale`, sorted."""
    out = Path(out)
    return sorted({p for pattern in stale for p in out.glob(pattern)})


def clean(out: Path, stale: Iterable[str]) -> None:
    """Remove the files and folders of `out` that match `stale` (a fresh run must not find them)."""
    for p in stale_files(out, stale):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunDir:
    """An output directory claimed for a run (see `claim`)."""

    path: Path
    overwrite: bool = False
    resume: bool = False
    stale: tuple[str, ...] = ()

    def start(self, resuming: bool | None = None, create: bool = True) -> Path:
        """Once the run's inputs are checked: on `overwrite`, unless `resuming` (default: `resume`), remove the
        previous run's stale files; create the directory (unless `create` is False). Returns its path."""
        resuming = self.resume if resuming is None else resuming
        if self.overwrite and not resuming and self.path.is_dir():
            clean(self.path, self.stale)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        return self.path


def claim(out: Path, *, overwrite: bool = False, resume: bool = False, stale: Iterable[str] = ()) -> RunDir:
    """Take `out` for a run: refuse (OutputExists, exit 2) an existing non-empty directory unless `overwrite`
    or `resume`. Writes nothing: `RunDir.start` cleans and creates once the inputs are known to be good.

    stale: glob patterns (relative to `out`) of the files a run writes for its progress, logs and results,
        which `--overwrite` removes so that a fresh run neither resumes from nor appends to them.
    """
    out = Path(out)
    check_out_dir(out, overwrite=overwrite, resume=resume)
    return RunDir(out, overwrite, resume, tuple(stale))


# ---------------------------------------------------------------- resumable state: JSON + safetensors

_TENSOR, _ITEMS, _TUPLE = "__tensor__", "__items__", "__tuple__"


def _encode(obj, tensors: dict, seen: dict) -> Any:
    """JSON for `obj`, its tensors moved into `tensors` (a tensor met twice, e.g. tied weights, is stored once;
    safetensors refuses two entries sharing memory, so other views of a stored tensor's memory are copied)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if view in seen:
            return {_TENSOR: seen[view]}
        if any(v[0] == view[0] for v in seen):
            t = t.clone()
        key = seen[view] = str(len(tensors))
        tensors[key] = t
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not {_TENSOR, _ITEMS, _TUPLE} & set(obj):
            return {k: _encode(v, tensors, seen) for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors, seen), _encode(v, tensors, seen)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, seen) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, seen) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot save a {type(obj).__name__} in a run state")


def _decode(obj, tensors: dict) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        if set(obj) == {_ITEMS}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj[_ITEMS]}
        if set(obj) == {_TUPLE}:
            return tuple(_decode(v, tensors) for v in obj[_TUPLE])
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_state(path: Path, state: dict) -> None:
    """Write `state` as `path` (JSON, `.json`) and, when it holds tensors, `path` with suffix `.safetensors`."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict = {}
    doc = _encode(state, tensors, {})
    if tensors:
        with atomic_path(path.with_suffix(".safetensors")) as tmp:
            save_file(tensors, str(tmp))
    write_json(path, {"tensors": path.with_suffix(".safetensors").name if tensors else None, "state": doc})


def load_state(path: Path) -> dict | None:
    """The state `save_state` wrote to `path` (None when there is none). Raises ValueError/OSError on a
    damaged pair; the caller turns that into its own message."""
    path = Path(path)
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    tensors = {}
    if doc.get("tensors"):
        from safetensors.torch import load_file

        tensors = load_file(str(path.parent / doc["tensors"]))
    return _decode(doc["state"], tensors)


__all__ = ["RunDir", "claim", "clean", "fingerprint", "load_state", "save_state", "stale_files"]
