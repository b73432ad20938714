"""Teacher feature cache: sharded safetensors on disk, plus a thread-pool prefetcher with a bounded queue.

Layout of one cache directory:
    shard-00000.safetensors  {"ids": (B, T) int64, "b0": (B, T, H), "b1": ..., ...}   one batch each
    index.json               written last, atomically: {"key", "n_shards", "keys", "dtype", "files"}

A cache is valid only when `index.json` exists and names every shard; each shard is written to a
temporary file and renamed, so a crash or a full disk never leaves half a shard that looks valid.
Readers open shards with `safe_open` and read only the keys they need (e.g. two boundaries).
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcompress.errors import UserError
from llmcompress.io.atomic import atomic_path, write_json

if TYPE_CHECKING:
    import torch

INDEX = "index.json"
CACHE_MICRO_BATCH = 2  # blocks per teacher forward while caching (bounds activation memory)
CACHE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str):
    import torch

    return getattr(torch, CACHE_DTYPES[name])


def cache_key(*parts: Any) -> str:
    """sha256 over the given parts (strings, numbers, lists, or tensors by their bytes), 16 hex digits."""
    import torch

    from llmcompress.metrics import update_tensor_digest

    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            update_tensor_digest(h, p)
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def _save_file(tensors: dict, path: str) -> None:
    """The one place shards hit the disk (tests replace it to simulate a full disk)."""
    from safetensors.torch import save_file

    save_file(tensors, path)


class FeatureCache:
    """A directory of feature shards with an index written last."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def index_path(self) -> Path:
        return self.root / INDEX

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    def index(self) -> dict | None:
        try:
            return json.loads(self.index_path.read_text())
        except (OSError, ValueError):
            return None

    def is_complete(self, key: str | None = None) -> bool:
        idx = self.index()
        if idx is None or (key is not None and idx.get("key") != key):
            return False
        return all((self.root / f).is_file() for f in idx.get("files", []))

    @property
    def n_shards(self) -> int:
        idx = self.index()
        return 0 if idx is None else int(idx["n_shards"])

    def write(self, shards: Iterable[dict[str, torch.Tensor]], *, key: str, meta: dict | None = None) -> None:
        """Write shards in order (each to a temp file, then renamed), then the index. Invalidates first.

        A full disk raises UserError; the directory is left without an index (so never taken as valid)
        and without temporary files.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.index_path.unlink(missing_ok=True)
        files, keys = [], None
        try:
            for i, tensors in enumerate(shards):
                path = self.shard_path(i)
                with atomic_path(path) as tmp:
                    _save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
                files.append(path.name)
                keys = keys or sorted(tensors)
            write_json(self.index_path, {"key": key, "n_shards": len(files), "keys": keys, "files": files, **(meta or {})})
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise UserError(
                    f"the disk filled while writing the feature cache in {self.root}",
                    "free some space or point --cache-dir at a larger disk, then rerun (the incomplete cache is ignored)",
                ) from None
            raise

    def read(self, i: int, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors of shard i (only `keys` when given)."""
        from safetensors import safe_open

        with safe_open(str(self.shard_path(i)), framework="pt") as f:
            return {k: f.get_tensor(k) for k in (keys if keys is not None else f.keys())}

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def prefetch(load: Callable[[Any], Any], items: Iterable[Any], *, depth: int = 2, workers: int = 1) -> Iterator[Any]:
    """Yield `load(item)` for each item, in order, loading up to `depth` items ahead in a thread pool.

    At most `depth` results are loaded but not yet consumed (plus the one the caller holds), so memory
    stays bounded however fast the disk is; the compute loop only waits when the disk is slower than it.
    """
    depth = max(1, depth)
    it = iter(items)
    pending: deque = deque()
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="llmc-prefetch")
    try:
        for item in it:
            pending.append(pool.submit(load, item))
            if len(pending) >= depth:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(it, _END)
            if nxt is not _END:
                pending.append(pool.submit(load, nxt))
            yield result
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)


_END = object()


# ------------------------------------------------------------------ building the teacher cache



class _StopAtNorm(Exception):
    pass


def teacher_features(model, input_ids, boundaries: list[int]) -> list:
    """Hidden states at the given layer boundaries (as `io.forward.boundary_states`, same hooks), in one
    no-grad pass that stops at the final norm: the head (about a fifth of a small model's FLOPs) and the
    (B, T, vocab) logits are never computed.
    """
    import torch

    from llmcompress.io.adapters import get_adapter

    adapter = get_adapter(model)
    layers = adapter.decoder_layers(model)
    want, got = set(boundaries), {}

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    def stop(module, args):
        raise _StopAtNorm

    hooks = [adapter.norm(model).register_forward_pre_hook(stop)]
    if 0 in want:
        hooks.append(layers[0].register_forward_pre_hook(lambda m, a, kw: got.__setitem__(0, a[0] if a else kw["hidden_states"]), with_kwargs=True))
    for i, layer in enumerate(layers):
        if i + 1 in want:
            hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i + 1, first(out))))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    except _StopAtNorm:
        pass
    finally:
        for h in hooks:
            h.remove()
    return [got[b] for b in boundaries]


def build_teacher_cache(
    teacher_model, blocks, boundaries: list[int], *, key: str, root: Path, batch_size: int, dtype: str, device,
    precision: str = "fp32",
) -> FeatureCache:
    """Teacher boundary features at `boundaries`, one shard per training batch (reused when the key matches).

    `precision` bf16 runs the teacher under bf16 autocast (the key must then say so).
    """
    import torch

    from llmcompress.progress import track
    from llmcompress.runtime import autocast

    cache = FeatureCache(root)
    if cache.is_complete(key):
        return cache
    bs = batch_size
    tdtype = torch_dtype(dtype)

    def shards():
        for s in track(range(0, len(blocks), bs), "caching teacher features", total=len(blocks) // bs):
            ids = blocks[s : s + bs]
            parts: dict[str, list] = {f"b{j}": [] for j in range(len(boundaries))}
            for m in range(0, len(ids), CACHE_MICRO_BATCH):
                with autocast(device, precision):
                    states = teacher_features(teacher_model, ids[m : m + CACHE_MICRO_BATCH].to(device), boundaries)
                for j, state in enumerate(states):
                    parts[f"b{j}"].append(state.to("cpu", tdtype))
                del states
            yield {"ids": ids.clone(), **{k: torch.cat(v) for k, v in parts.items()}}

    cache.write(shards(), key=key, meta={"boundaries": boundaries, "dtype": dtype})
    return cache
