"""Benchmark: sampling `self` training text from smollm2-135m, batch 32 (ours) vs batch 4 (before).

Run: .venv/bin/python bench/bench_selfdata.py [--blocks 64] [--seq-len 256] [--threads 2]
Each batch size samples the same number of blocks through `llmcompress.data.blocks.self_text_blocks`
into its own empty cache (nothing is reused); prints tokens/s per batch size and the ratio to batch 4.
This is the cost of `--data self` that healing a pruned student on fresh text would pay per token.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batches", default="4,32,64", help="batch sizes; the first is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("LLMCOMPRESS_PROGRESS", "0")
    import torch

    from llmcompress.data.blocks import self_text_blocks
    from llmcompress.io.load import load_model

    torch.set_num_threads(a.threads)
    lm = load_model("smollm2-135m")
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        with tempfile.TemporaryDirectory() as d:
            os.environ["LLMCOMPRESS_CACHE_DIR"] = d
            t0 = time.perf_counter()
            blocks = self_text_blocks(lm.model, lm.tokenizer, a.seq_len, a.blocks, seed=0, batch=b)
            s = time.perf_counter() - t0
        rows.append((b, s, blocks.numel() / s))
        print(f"batch {b:3d}: {blocks.numel():,} tokens in {s:.1f} s = {blocks.numel() / s:.0f} tokens/s", flush=True)
    base = rows[0][2]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.threads} thread(s), {a.blocks} blocks x {a.seq_len}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| batch | seconds | tokens/s | vs batch " + str(rows[0][0]) + " |\n|---|---|---|---|")
    for b, s, tps in rows:
        print(f"| {b} | {s:.1f} | {tps:.0f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
