"""Tokenize and pack text into fixed-length blocks; deterministic under a seed, cached by content hash."""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmcompress.errors import DataError
from llmcompress.io.atomic import atomic_path
from llmcompress.paths import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmcompress")

SELF_BATCH = 32  # sequences sampled at once by `self_text_blocks`


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}:{len(tokenizer)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_stream(tokenizer, texts: list[str], *, cache: bool = True) -> torch.Tensor:
    """All texts tokenized and concatenated (documents joined by a blank line), as a 1-D LongTensor."""
    import numpy as np
    import torch

    text = "\n\n".join(texts)
    key = hashlib.sha256(text.encode()).hexdigest()[:16] + "-" + tokenizer_fingerprint(tokenizer)
    path = cache_dir() / "tokens" / f"{key}.npy"
    if cache and path.is_file():
        try:
            return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
        except (OSError, ValueError):
            path.unlink(missing_ok=True)  # a bad cache entry is rebuilt
    ids = _tokenize_chunked(tokenizer, text)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            np.save(tmp, ids.numpy().astype(np.int32))
    return ids


def _tokenize_chunked(tokenizer, text: str, chunk_chars: int = 1 << 18) -> torch.Tensor:
    """Tokenize a long text in paragraph-aligned pieces (with a progress bar), without special tokens."""
    import torch

    from llmcompress.progress import track

    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    ids: list[int] = []
    for piece in track(pieces, "tokenizing", total=len(pieces)):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def pack_blocks(
    ids: torch.Tensor, seq_len: int, *, n_blocks: int | None = None, seed: int | None = None, offset: int = 0
) -> torch.Tensor:
    """Cut a token stream into non-overlapping (n, seq_len) blocks.

    Args:
        ids: 1-D token stream.
        seq_len: block length.
        n_blocks: how many blocks to return (all when None).
        seed: when given, blocks are a seeded random choice (without replacement); else the first ones.
        offset: skip this many blocks first (in the seeded order when seeded): disjoint calibration and
            validation sets come from the same seed with different offsets.
    """
    import torch

    total = ids.numel() // seq_len
    if total - offset < 1:
        raise DataError(
            f"the data holds {ids.numel()} tokens, shorter than one block of {seq_len}",
            "use more text or a smaller --seq-len",
        )
    blocks = ids[: total * seq_len].view(total, seq_len)
    n = total - offset if n_blocks is None else min(n_blocks, total - offset)
    if seed is None:
        return blocks[offset : offset + n].clone()
    # one seeded permutation of all blocks: offset/n pick disjoint slices of it (calibration vs validation)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[offset : offset + n]
    return blocks[order].clone()


def self_text_blocks(model, tokenizer, seq_len: int, n_blocks: int, seed: int, batch: int = SELF_BATCH) -> torch.Tensor:
    """Data-free calibration: sequences sampled from the model itself, starting from random vocabulary tokens.

    Sampled `batch` sequences at a time (with the KV cache; a larger batch amortises reading the weights).
    Cached by (model weights fingerprint, seq_len, n_blocks, seed, batch). Each finished batch is kept
    (written atomically) until all are done, so an interrupted sampling resumes where it stopped.
    """
    import shutil

    import torch

    from llmcompress.progress import track

    first = next(model.parameters())
    fp = hashlib.sha256(first.detach().float().cpu().numpy().tobytes()[:1 << 20]).hexdigest()[:12]
    path = cache_dir() / "self-data" / f"{fp}-{seq_len}-{n_blocks}-{seed}-b{batch}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    parts = path.with_suffix(".parts")
    parts.mkdir(parents=True, exist_ok=True)
    prompts = torch.randint(0, len(tokenizer), (n_blocks, 1), generator=torch.Generator().manual_seed(seed))
    out = []
    for start in track(range(0, n_blocks, batch), "sampling self data", total=(n_blocks + batch - 1) // batch):
        b = min(batch, n_blocks - start)
        part = parts / f"{start}-{b}.pt"
        if part.is_file():
            out.append(torch.load(part, weights_only=True))
            continue
        torch.manual_seed(seed + start)
        with torch.no_grad():
            seq = model.generate(
                prompts[start : start + b].to(first.device), do_sample=True, top_p=0.95, temperature=1.0,
                max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1, pad_token_id=tokenizer.pad_token_id,
            )
        out.append(seq[:, :seq_len].cpu())
        with atomic_path(part) as tmp:
            torch.save(out[-1], tmp)
    blocks = torch.cat(out)
    with atomic_path(path) as tmp:
        torch.save(blocks, tmp)
    shutil.rmtree(parts, ignore_errors=True)
    return blocks


def calibration_blocks(
    tokenizer,
    source: str = "wikitext2",
    *,
    split: str | None = "valid",
    seq_len: int = 256,
    n_blocks: int = 32,
    seed: int = 0,
    offset: int = 0,
    model=None,
    allow_self_fallback: bool = True,
) -> tuple[torch.Tensor, str]:
    """(n_blocks, seq_len) token blocks for calibration or training, and a description of their origin.

    `source` is a named dataset (`name` or `name:split`), a file, several of these joined by commas
    (their token streams concatenated, blocks drawn from all), or `self` (sampled from `model`). When a
    single named dataset cannot be reached and `model` is given, falls back to `self` with a notice on stderr.
    """
    import torch

    from llmcompress.data.sources import DATASETS, is_named, load_texts

    parts = split_sources(source, split)
    if source == "self":
        if model is None:
            raise DataError("`self` data needs the model", "pass the model to sample from")
        return self_text_blocks(model, tokenizer, seq_len, n_blocks, _self_seed(seed, offset)), "self (sampled from the model)"
    if len(parts) > 1 and any(name == "self" for name, _ in parts):
        raise DataError(f"`self` cannot be mixed with other data in {source!r}", "use `self` alone, or only datasets and files")
    streams, labels = [], []
    for name, part_split in parts:
        try:
            texts = load_texts(name, part_split)
        except DataError as exc:
            if not (allow_self_fallback and model is not None and len(parts) == 1 and name in DATASETS):
                raise
            print(f"notice: {exc.message}; falling back to data-free `self` text sampled from the model", file=sys.stderr)
            return self_text_blocks(model, tokenizer, seq_len, n_blocks, _self_seed(seed, offset)), "self (fallback: data unreachable)"
        streams.append(token_stream(tokenizer, texts))
        labels.append(f"{name}:{part_split}" if is_named(name) else str(Path(name)))
    ids = streams[0] if len(streams) == 1 else torch.cat(streams)
    return pack_blocks(ids, seq_len, n_blocks=n_blocks, seed=seed, offset=offset), "+".join(labels)


def _self_seed(seed: int, offset: int) -> int:
    """Sampling seed of `self` text: blocks asked for at an offset (validation after calibration) get their own
    seed, so they are other samples than the blocks at offset 0 rather than a copy of their first ones."""
    return seed if offset == 0 else seed + 7919 * offset


def split_sources(source: str, split: str | None) -> list[tuple[str, str | None]]:
    """The parts of a `--data` value: comma-separated sources, each a dataset (with an optional `:split`) or a file.

    `wikitext2,tinyshakespeare:all` -> [("wikitext2", split), ("tinyshakespeare", "all")]: a named part
    without its own split takes `split`. A part that names an existing file is a file, even with a colon.
    """
    from llmcompress.data.sources import is_named

    out: list[tuple[str, str | None]] = []
    for part in (p.strip() for p in source.split(",")):
        if not part:
            raise DataError(f"empty source in --data {source!r}", "separate sources with single commas, e.g. wikitext2,tinyshakespeare:all")
        name, sep, own = part.partition(":")
        if sep and is_named(name) and not Path(part).exists():
            out.append((name, own))
        else:
            out.append((part, split))
    return out
