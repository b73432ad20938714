"""Perplexity over non-overlapping windows of a token stream."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llmcompress.errors import UserError

if TYPE_CHECKING:
    import torch


def context_length(model) -> int | None:
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def check_seq_len(model, seq_len: int) -> None:
    limit = context_length(model)
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len} is too short", "use 2 or more")
    if limit is not None and seq_len > limit:
        raise UserError(f"--seq-len {seq_len} is beyond the model's context of {limit} tokens", f"use --seq-len {limit} or less")


def nll_of_blocks(model, blocks: torch.Tensor, batch_size: int = 4, description: str = "perplexity") -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods over (n, T) blocks, and the number of scored tokens.

    Each block is scored on its own (no context from the previous one): T-1 predictions per block.
    """
    import torch
    import torch.nn.functional as F

    from llmcompress.progress import track

    device = next(model.parameters()).device
    total, count = 0.0, 0
    starts = range(0, blocks.shape[0], batch_size)
    with torch.no_grad():
        for s in track(starts, description, total=len(starts)):
            x = blocks[s : s + batch_size].to(device)
            logits = model(input_ids=x, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    return total, count


def perplexity(
    model,
    tokenizer,
    data: str = "wikitext2",
    *,
    split: str | None = None,
    seq_len: int = 512,
    max_tokens: int | None = 16384,
    batch_size: int = 4,
) -> dict:
    """Perplexity on the first `max_tokens` tokens of a dataset or file, in windows of `seq_len`.

    Returns {"ppl", "nll", "tokens_scored", "windows", "seq_len", "data"}.
    """
    check_seq_len(model, seq_len)
    blocks = perplexity_blocks(tokenizer, data, split=split, seq_len=seq_len, max_tokens=max_tokens)
    nll, n = nll_of_blocks(model, blocks, batch_size=batch_size, description=f"ppl {data}")
    return perplexity_result(nll, n, blocks, data, split)


def perplexity_blocks(tokenizer, data: str, *, split: str | None = None, seq_len: int = 512, max_tokens: int | None = 16384) -> torch.Tensor:
    """The (windows, seq_len) token blocks every perplexity runtime scores: the first `max_tokens` tokens
    of the dataset, cut into non-overlapping windows (stride = seq_len), each scored on its own."""
    from llmcompress.data.blocks import pack_blocks, token_stream
    from llmcompress.data.sources import load_texts

    ids = token_stream(tokenizer, load_texts(data, split))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return pack_blocks(ids, seq_len)


def perplexity_result(nll: float, n: int, blocks: torch.Tensor, data: str, split: str | None = None) -> dict:
    return {
        "ppl": math.exp(nll / n),
        "nll": nll / n,
        "tokens_scored": n,
        "tokens": int(blocks.numel()),
        "windows": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "data": data if split is None else f"{data}:{split}",
    }
