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
    ap.add_argument("--equal-latency", action=argparse.BooleanOptionalAction, default=True,
                    help="also run joint at the modeled latency sequential reached")
    ap.add_argument("--equal-ppl", action=argparse.BooleanOptionalAction, default=True,
                    help="also run joint at 1/1.3 of sequential's modeled latency: the issue's 'at equal perplexity, "
                         ">= 1.3x lower latency' holds when joint's perplexity there is still <= sequential's")
    ap.add_argument("--reuse", action="store_true", help="skip the main run; reuse OUT/arch.json for the extra runs")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "llmcompress", "nas", "smollm2-135m", "--target-latency", "0.6", "--target-bits", "4",
           "--mode", "joint", "--baselines", "sequential,uniform", "--cost-model", args.cost_model,
           "--train-tokens", str(args.train_tokens), "--eval-tokens", str(args.eval_tokens), "--out", args.out, "--overwrite"]
    env = {**os.environ, "LLMCOMPRESS_PROGRESS": os.environ.get("LLMCOMPRESS_PROGRESS", "0")}
    shared = ROOT.parent / "shared" / "data"
    if "LLMCOMPRESS_DATA_DIR" not in env and shared.is_dir():
        env["LLMCOMPRESS_DATA_DIR"] = str(shared)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    if not args.reuse:
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    wall = time.time() - t0
    out = ROOT / args.out
    report = (out / "report.md").read_text()
    arch = json.loads((out / "arch.json").read_text())
    text = [] if args.reuse else [
        f"## Run of {time.strftime('%Y-%m-%d %H:%M')} UTC",
        "",
        "Command: `" + " ".join(["python", *cmd[1:]]) + "`",
        "",
        f"Wall time {wall / 60:.1f} min on {os.cpu_count()} CPU cores, load average at start {load0:.1f}. hf/ (dequantized, "
        f"{arch.get('hf_dtype', 'float32')}, zero-padded) {arch.get('hf_disk_mb', 0):.1f} MB"
        + "".join(f"; {f} {e['bytes'] / 1e6:.1f} MB" for f, e in arch.get("exports", {}).items()) + ".",
        "",
        report.split("\n", 2)[2],
    ]
    ref = arch.get("refine")
    if ref and not args.reuse:
        kls = ", ".join(f"{k} {v:.4f}" for k, v in ref["start_kl"].items())
        text += [f"Validated last step (held-out calibration blocks, RTN weights): KL of the start candidates {kls}; "
                 f"exported: {ref['start']} (+ {ref['accepted']} of {ref['evaluated']} mutations accepted), KL {ref['final_kl']:.4f}.", ""]
    seq = arch.get("baselines", {}).get("sequential")

    def joint_at(lat: float, suffix: str) -> dict:
        """Joint alone (no baselines) at another latency target; its arch.json."""
        c = [*cmd[: cmd.index("--target-latency") + 1], str(lat), *cmd[cmd.index("--target-latency") + 2 :]]
        c[c.index("--baselines") + 1] = ""
        c[c.index("--out") + 1] = args.out + suffix
        subprocess.run(c, check=True, cwd=ROOT, env=env)
        return json.loads((ROOT / (args.out + suffix) / "arch.json").read_text())

    if args.equal_latency and seq and not args.reuse:
        # joint again, at the modeled latency the sequential baseline reached: the equal-latency comparison
        lat = round(seq["modeled_latency"], 4)
        a2 = joint_at(lat, "-eqlat")
        p_seq, p_joint = seq["metrics"].get("ppl"), a2["metrics"].get("ppl")
        text += ["", f"Equal modeled latency: joint rerun with `--target-latency {lat}` (the latency sequential reached) "
                 f"and `--baselines ''`: joint ppl {p_joint:.2f} at latency {a2['modeled_latency']:.3f}, {a2['avg_bits']:.2f} bits, "
                 f"{a2['architecture']['kept']} layers; sequential ppl {p_seq:.2f} at {seq['modeled_latency']:.3f} "
                 f"(joint/sequential {p_joint / p_seq:.3f})."]
    if args.equal_ppl and seq:
        # joint at 1/1.3 of sequential's latency: if its perplexity is still no worse, then at equal perplexity
        # joint reaches >= 1.3x lower modeled latency (the second goal)
        lat = round(seq["modeled_latency"] / 1.3, 4)
        t3 = time.time()
        a3 = joint_at(lat, "-eqppl")
        p_seq, p_joint = seq["metrics"].get("ppl"), a3["metrics"].get("ppl")
        text += ["", f"Equal perplexity ({time.strftime('%Y-%m-%d %H:%M')} UTC, {(time.time() - t3) / 60:.1f} min): joint rerun with "
                 f"`--target-latency {lat}` (sequential's {seq['modeled_latency']:.3f} / 1.3) and `--baselines ''`: joint ppl "
                 f"{p_joint:.2f} at latency {a3['modeled_latency']:.3f}, {a3['avg_bits']:.2f} bits, {a3['architecture']['kept']} layers; "
                 f"sequential ppl {p_seq:.2f} at {seq['modeled_latency']:.3f}: joint's perplexity is "
                 f"{'no worse' if p_joint <= p_seq else 'worse'} at {seq['modeled_latency'] / a3['modeled_latency']:.2f}x lower latency."]
    path = ROOT / "bench" / "RESULTS-nas.md"
    head = path.read_text() if path.is_file() else "# llmcompress nas benchmark results\n\n"
    path.write_text(head + "\n".join(text) + "\n")
    print(report)


if __name__ == "__main__":
    main()
