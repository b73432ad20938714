"""Run a GGUF in llama.cpp (through llama-cpp-python): prefill/decode tokens/s and perplexity from its logits.

llama-cpp-python is an optional extra (`pip install -e .[runtime]`: it compiles llama.cpp from source), so
it is imported inside the functions here and only when asked for. What is hand-written, and why:
llama-cpp-python has no perplexity API (llama.cpp's `llama-perplexity` tool scores the second half of
each window only and tokenizes on its own), so the windows here are the very token blocks the torch
evaluation scores (`eval.perplexity.perplexity_blocks`: same tokenizer ids, window = stride = seq_len,
each window scored on its own, seq_len - 1 predictions per window), and the negative log-likelihood is
taken from llama.cpp's own logits of every position (`logits_all=True`). The two numbers are therefore
directly comparable: any gap is the runtime's arithmetic (quantized activations in its dot products).

Speed on a shared machine: ggml's OpenMP threads spin at barriers, so with the cores oversubscribed a
multi-threaded run slows down by an order of magnitude; `OMP_WAIT_POLICY=PASSIVE` in the environment (read
when llama.cpp loads) avoids it. It is left to the user: on idle cores spinning is the faster choice.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmcompress.errors import UserError
from llmcompress.runtime import default_threads

if TYPE_CHECKING:
    import torch

RUNTIMES = ("torch", "llama.cpp")
PROMPT_LEN = 256  # prefill: tokens of one prompt, timed as one llama_decode of the whole prompt (batch 1)
DECODE_TOKENS = 64  # decode: tokens generated one at a time after that prompt, with the KV cache
REPEATS = 5  # both are the median of this many runs
INSTALL_HINT = "install the optional runtime: pip install -e .[runtime] (it compiles llama.cpp)"


def require_llama_cpp():
    """The `llama_cpp` module, or a UserError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError("--runtime llama.cpp needs llama-cpp-python, which is not installed", INSTALL_HINT) from None
    return llama_cpp


AMX_WARNING = (
    "warning: this llama-cpp-python was built with AMX (llama_print_system_info: AMX_INT8 = 1); on CPUs that lose "
    "the AMX tile state, Q4_0/Q4_1/Q8_0 GGUFs then die with SIGILL on prompts of 2 or more tokens. If that happens, "
    "rebuild it without AMX: CMAKE_ARGS=\"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" pip install --no-cache-dir --force-reinstall "
    "llama-cpp-python (llmcompress/export/README.md, Known limits)"
)
_warned_amx = False


def system_info() -> str:
    """llama.cpp's build features (llama_print_system_info: SIMD, AMX, REPACK, OpenMP)."""
    info = require_llama_cpp().llama_print_system_info()
    return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()


def warn_if_amx_build() -> None:
    """Print AMX_WARNING on stderr, once per process, when llama.cpp was built with its AMX kernels: the crash
    itself kills the process (SIGILL) without a message, so the hint has to come before it."""
    global _warned_amx
    if not _warned_amx and "AMX_INT8 = 1" in system_info():
        _warned_amx = True
        print(AMX_WARNING, file=sys.stderr, flush=True)


def open_gguf(path: str | Path, *, n_ctx: int, threads: int | None = None, logits_all: bool = False):
    """A llama_cpp.Llama on the CPU, quiet, with `threads` threads for both prefill and decode."""
    llama_cpp = require_llama_cpp()
    warn_if_amx_build()
    threads = threads or default_threads()
    try:
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=0, logits_all=logits_all, verbose=False,
        )
    except ValueError as exc:  # llama-cpp-python raises ValueError when llama.cpp cannot load the file
        raise UserError(f"llama.cpp could not load {path}: {exc}", "check that the file is a complete GGUF of an architecture llama.cpp runs") from None


def window_nll(logits, block) -> float:
    """Sum of next-token negative log-likelihoods of one window: `logits` (T, vocab) at each position,
    `block` (T,) the token ids; T - 1 predictions, computed in float64."""
    import torch
    import torch.nn.functional as F

    lg = torch.as_tensor(logits, dtype=torch.float64)
    return F.cross_entropy(lg[:-1], torch.as_tensor(block[1:], dtype=torch.long), reduction="sum").item()


def nll_of_blocks_llamacpp(llm, blocks: torch.Tensor, description: str = "perplexity (llama.cpp)") -> tuple[float, int]:
    """Like `eval.perplexity.nll_of_blocks`, with llama.cpp's logits: each block scored on its own."""
    from llmcompress.progress import track

    total, count = 0.0, 0
    for row in track(range(blocks.shape[0]), description, total=blocks.shape[0]):
        block = blocks[row]
        llm.reset()  # the next eval starts at position 0 and drops the KV cache from there
        llm.eval(block.tolist())
        total += window_nll(llm.scores[: block.numel()], block)
        count += block.numel() - 1
    return total, count


def llamacpp_perplexity(
    path: str | Path, tokenizer, data: str = "wikitext2", *, split: str | None = None, seq_len: int = 512,
    max_tokens: int | None = 16384, threads: int | None = None, llm=None,
) -> dict:
    """Perplexity of the GGUF at `path` from llama.cpp's logits, on the same windows as `eval.perplexity`."""
    from llmcompress.eval.perplexity import perplexity_blocks, perplexity_result

    blocks = perplexity_blocks(tokenizer, data, split=split, seq_len=seq_len, max_tokens=max_tokens)
    llm = llm or open_gguf(path, n_ctx=seq_len, threads=threads, logits_all=True)
    nll, n = nll_of_blocks_llamacpp(llm, blocks, description=f"ppl {data} (llama.cpp)")
    return perplexity_result(nll, n, blocks, data, split)


def llamacpp_speed(
    path: str | Path, *, threads: int | None = None, prompt_len: int = PROMPT_LEN, decode_tokens: int = DECODE_TOKENS,
    repeats: int = REPEATS, llm=None,
) -> dict:
    """Prefill and decode tokens/s of the GGUF at `path` in llama.cpp, each the median of `repeats` runs.

    One run: a `prompt_len`-token prompt evaluated at once (prefill), then `decode_tokens` tokens fed one at a
    time with the KV cache (decode). The tokens are fixed pseudo-random ids: a step's cost does not
    depend on which token it is. Wall-clock time around llama_decode, after one untimed warm-up run.
    """
    import numpy as np

    threads = threads or default_threads()
    llm = llm or open_gguf(path, n_ctx=prompt_len + decode_tokens, threads=threads)
    vocab = llm.n_vocab()
    ids = np.random.default_rng(0).integers(min(10, vocab - 1), vocab, prompt_len + decode_tokens).tolist()
    prefill, decode = [], []
    for run in range(repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:prompt_len])
        t1 = time.perf_counter()
        for tok in ids[prompt_len:]:
            llm.eval([tok])
        t2 = time.perf_counter()
        if run:  # run 0 warms caches and pages the weights in
            prefill.append(prompt_len / (t1 - t0))
            decode.append(decode_tokens / (t2 - t1))
    return {
        "prefill_tokens_per_s": statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "threads": threads,
        "speed_protocol": f"prompt {prompt_len}, decode {decode_tokens}, median of {repeats}",
        "device": "cpu (llama.cpp)",
    }


def evaluate_llamacpp(path: str | Path, tokenizer, spec, *, threads: int | None = None, torch_row: dict | None = None) -> dict:
    """A row like `eval.report.evaluate`'s, measured in llama.cpp; with `torch_row`, also the ratio of each
    perplexity to torch's on the same weights (`ppl/DATA/vs_torch`)."""
    from llmcompress.eval.speed import disk_bytes, peak_rss_mb

    t0 = time.perf_counter()
    row: dict = {"model": f"{path} [llama.cpp]", "runtime": "llama.cpp", "disk_bytes": disk_bytes(path)}
    if spec.ppl:
        llm = open_gguf(path, n_ctx=spec.seq_len, threads=threads, logits_all=True)
        for data in spec.ppl:
            t_data = time.perf_counter()
            r = llamacpp_perplexity(path, tokenizer, data, seq_len=spec.seq_len, max_tokens=spec.max_tokens, llm=llm)
            row[f"ppl/{data}"] = r["ppl"]
            row[f"ppl/{data}/tokens_scored"] = r["tokens_scored"]
            row[f"ppl/{data}/tokens_per_s"] = r["tokens"] / max(1e-9, time.perf_counter() - t_data)
            if torch_row and torch_row.get(f"ppl/{data}"):
                row[f"ppl/{data}/vs_torch"] = r["ppl"] / torch_row[f"ppl/{data}"]
        del llm
    if spec.speed:
        row.update(llamacpp_speed(path, threads=threads))
    row["peak_rss_mb"] = peak_rss_mb()
    row["eval_seconds"] = time.perf_counter() - t0
    return row
