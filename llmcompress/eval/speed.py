"""Size and speed: parameters, bytes on disk, prefill and decode tokens/s, peak memory."""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def disk_bytes(path: str | Path | None) -> int | None:
    if path is None or not Path(path).exists():
        return None
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".llmz", ".gguf"))


def cache_kwarg(model) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache`; accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def measure_speed(model, *, prompt_len: int = 256, decode_tokens: int = 32, repeats: int = 2, vocab: int | None = None) -> dict:
    """Measured prefill tokens/s (batch 1, `prompt_len` tokens) and greedy decode tokens/s with the KV cache."""
    import torch

    device = next(model.parameters()).device
    vocab = vocab or model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (1, prompt_len), generator=g).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    cache_kw = cache_kwarg(model)
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=False)  # warm-up
        best_prefill = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            sync()
            best_prefill = min(best_prefill, time.perf_counter() - t0)
        # decode: time per new token after the prompt is in the cache
        best_decode = float("inf")
        for _ in range(repeats):
            out = model(input_ids=ids[:, :64], use_cache=True)
            cache, nxt = cache_of(out), out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(input_ids=nxt, **{cache_kw: cache}, use_cache=True)
                cache, nxt = cache_of(out), out.logits[:, -1:].argmax(-1)
            sync()
            best_decode = min(best_decode, time.perf_counter() - t0)
    result = {
        "prefill_tokens_per_s": prompt_len / best_prefill,
        "decode_tokens_per_s": decode_tokens / best_decode,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def size_info(model, path: str | Path | None = None) -> dict:
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "parameters": params,
        "layers": model.config.num_hidden_layers,
        "param_bytes": param_bytes,
        "disk_bytes": disk_bytes(path) if path is not None and os.path.exists(str(path)) else None,
    }
