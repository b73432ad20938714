"""Benchmark of `llmcompress nas` on smollm2-135m: joint vs sequential (NAS-then-quantize) vs uniform RTN.

Runs one CLI command (joint search, with sequential and uniform baselines in the same run) and appends the
figures to bench/RESULTS-nas.md. Reduced settings (the CPU is shared): see ARGS below.

    .venv/bin/python bench/bench_nas.py [--out runs/bench-nas] [--train-tokens 4096] [--eval-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench-nas")
    ap.add_argument("--train-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--cost-model", default="analytic")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "llmcompress", "nas", "smollm2-135m", "--target-latency", "0.6", "--target-bits", "4",
           "--mode", "joint", "--baselines", "sequential,uniform", "--cost-model", args.cost_model,
           "--train-tokens", str(args.train_tokens), "--eval-tokens", str(args.eval_tokens), "--out", args.out, "--overwrite"]
    env = {**os.environ, "LLMCOMPRESS_PROGRESS": os.environ.get("LLMCOMPRESS_PROGRESS", "0")}
    shared = ROOT.parent / "shared" / "data"
    if "LLMCOMPRESS_DATA_DIR" not in env and shared.is_dir():
        env["LLMCOMPRESS_DATA_DIR"] = str(shared)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    wall = time.time() - t0
    out = ROOT / args.out
    report = (out / "report.md").read_text()
    arch = json.loads((out / "arch.json").read_text())
    text = [
        f"## Run of {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "Command: `" + " ".join(["python", *cmd[1:]]) + "`",
        "",
        f"Wall time {wall / 60:.1f} min on {os.cpu_count()} shared CPU cores. Packed checkpoint on disk "
        f"{arch.get('packed_disk_mb', 0):.1f} MB, HF (float32, zero-padded) {arch.get('hf_disk_mb', 0):.1f} MB.",
        "",
        report.split("\n", 2)[2],
    ]
    path = ROOT / "bench" / "RESULTS-nas.md"
    head = path.read_text() if path.is_file() else "# llmcompress nas benchmark results\n\n"
    path.write_text(head + "\n".join(text) + "\n")
    print(report)


if __name__ == "__main__":
    main()
