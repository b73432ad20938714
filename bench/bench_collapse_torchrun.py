"""`collapse` on smollm2-135m in 1 process and in 2 torchrun processes (gloo), side by side (issue 20, item 3).

    python bench/bench_collapse_torchrun.py [--work runs/collapse-torchrun] [--generations 4] [--population 8]
                                            [--calib-tokens 2048] [--val-tokens 2048]

Three runs of the same seeded `--pareto` search (no refinement, tuning or LaCo, so the search is what is
compared) on the same 2 cores: 1 process with 2 torch threads (what a user runs without torchrun: the speed
baseline), 1 process with 1 thread, and `torchrun --nproc_per_node 2` with 1 thread per rank (each rank scores
a slice of every population; the fitness values are all-gathered). Identity is checked between the last two,
which do the same arithmetic per candidate (a different thread count changes the reduction order, so float
sums differ in the last bits, and in bf16 fitness visibly): every generation's front (layer counts, fitness
values, from search_log.jsonl) and the final front's candidates (pareto.json). Prints and writes
WORK/RESULTS.md: search seconds, evaluations per second and the 2-process speed-up over both 1-process runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from torchrun_arms import run_arms


def spec(args) -> str:
    return "\n".join([
        "pareto: true", f"population: {args.population}", f"generations: {args.generations}", "seed: 0",
        f"calib_tokens: {args.calib_tokens}", f"val_tokens: {args.val_tokens}", "refine_steps: 0", "tune_steps: 0",
        "baselines: [shortgpt]", "eval_tokens: 512", "save: knee", ""])


def measure(out: Path, wall: float) -> dict:
    log = [json.loads(line) for line in (out / "search_log.jsonl").read_text().splitlines()]
    meta = json.loads((out / "pareto.json").read_text())
    return {"wall_s": wall, "search_s": meta["search_seconds"], "evaluations": log[-1]["evaluations"],
            "fronts": [[(f["layers"], f["fitness_calib"], f["fitness_val"]) for f in g["front"]] for g in log],
            "final": [(r["layers"], r["changes"], r["fitness_calib"]) for r in meta["front"]],
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/collapse-torchrun"))
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--population", type=int, default=8)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--val-tokens", type=int, default=2048)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spec_file = args.work / "spec.yaml"
    spec_file.write_text(spec(args))
    res = {}
    for name, out, wall in run_arms(args.work, lambda out: ["collapse", "smollm2-135m", "--spec", str(spec_file), "--out", str(out)]):
        res[name] = r = measure(out, wall)
        print(f"  search {r['search_s']:.0f} s, {r['evaluations']} evaluations, {r['evaluations'] / r['search_s']:.3f}/s "
              f"(wall {r['wall_s']:.0f} s, load {r['load']:.1f})", flush=True)
    a2, a1, b = res.values()
    same = a1["fronts"] == b["fronts"] and a1["final"] == b["final"]
    near = [f[:2] for f in a2["final"]] == [f[:2] for f in b["final"]]  # candidates only: its fitness sums differ in the last bits
    lines = ["# collapse: 1 process vs 2 torchrun processes (gloo), smollm2-135m", "",
             f"Command: `python bench/bench_collapse_torchrun.py {' '.join(sys.argv[1:])}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
             f"Spec: `{spec(args).strip().replace(chr(10), '; ')}`.", "",
             "| run | search s | evaluations | evaluations/s | wall s | load at end |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['search_s']:.0f} | {r['evaluations']} | {r['evaluations'] / r['search_s']:.3f} | {r['wall_s']:.0f} | {r['load']:.1f} |")
    rate = {k: r["evaluations"] / r["search_s"] for k, r in res.items()}
    k2, k1, kb = res
    lines += ["", f"2 processes vs 1 process with 1 thread: every generation's front and the final candidates identical, "
              f"bit for bit: **{same}**. Against 1 process with 2 threads: same final candidates (fitness values within float/bf16 "
              f"rounding of another thread count): {near}. "
              f"Evaluations/s of 2 processes: **{rate[kb] / rate[k2]:.2f}×** the 2-thread process's, "
              f"{rate[kb] / rate[k1]:.2f}× the 1-thread process's."]
    (args.work / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
