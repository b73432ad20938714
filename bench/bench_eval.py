"""Evaluation throughput and model loading, ours vs plain transformers, in one run.

    python bench/bench_eval.py [--max-tokens 16384] [--seq-len 512]

Prints perplexity and tokens/s for `llmcompress.eval.perplexity` and for a plain transformers loop
over the same windows (the baseline), and the load time of the cached float checkpoint vs the GGUF.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("LLMCOMPRESS_PROGRESS", "0")


def _load_seconds(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    import torch

    from llmcompress.data.blocks import token_stream
    from llmcompress.data.sources import load_texts
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    lm = load_model("smollm2-135m")
    t0 = time.perf_counter()
    ours = perplexity(lm.model, lm.tokenizer, "wikitext2", seq_len=args.seq_len, max_tokens=args.max_tokens)
    t_ours = time.perf_counter() - t0

    # baseline: plain transformers, one window at a time, loss from labels=
    ids = token_stream(lm.tokenizer, load_texts("wikitext2"))[: args.max_tokens]
    n = ids.numel() // args.seq_len
    t0 = time.perf_counter()
    with torch.no_grad():
        losses = [lm.model(input_ids=w[None], labels=w[None]).loss.item() for w in ids[: n * args.seq_len].view(n, -1)]
    t_base = time.perf_counter() - t0
    base_ppl = math.exp(sum(losses) / len(losses))

    load_cached = _load_seconds(
        "import time, torch, transformers, llmcompress.io.load as L; L.quiet_transformers();"
        "t=time.perf_counter(); L.load_model('smollm2-135m'); print(time.perf_counter()-t)"
    )
    load_gguf = _load_seconds(
        "import time, torch, transformers; from llmcompress.io.load import alias_gguf_path, ALIASES, quiet_transformers;"
        "quiet_transformers(); p=alias_gguf_path(ALIASES['smollm2-135m']); t=time.perf_counter();"
        "transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32);"
        "transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name); print(time.perf_counter()-t)"
    )
    result = {
        "tokens": n * args.seq_len,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "ours": {"ppl": ours["ppl"], "seconds": t_ours, "tokens_per_s": n * args.seq_len / t_ours},
        "plain_transformers": {"ppl": base_ppl, "seconds": t_base, "tokens_per_s": n * args.seq_len / t_base},
        "speed_ratio_ours_vs_plain": t_base / t_ours,
        "load_seconds": {"cached_safetensors": load_cached, "gguf_dequantize": load_gguf, "ratio": load_gguf / load_cached},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
