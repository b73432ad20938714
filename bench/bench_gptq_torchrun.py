"""GPTQ export of smollm2-135m in 1 process and in 2 torchrun processes (gloo), side by side (issue 20, item 3).

    python bench/bench_gptq_torchrun.py [--work runs/gptq-torchrun] [--to compressed-tensors] [--bits 4] [--group-size 64]

Three runs of the same `llmcompress export smollm2-135m --quant gptq` on the same cores: 1 process with 2
torch threads (what a user runs without torchrun: the speed baseline), 1 process with 1 thread, and
`torchrun --nproc_per_node 2` with 1 thread per rank (every rank runs each layer's forward and Hessians,
quantizes its share of the layer's linears, `quant.gptq.assign_linears`, and the integers are all-gathered;
rank 0 writes). Identity is checked between the last two, which do the same arithmetic per linear: the
sha256 of every written safetensors file. Prints and writes WORK/RESULTS.md: wall seconds and the 2-process
speed-up over both 1-process runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from torchrun_arms import run_arms


def digest(out: Path) -> dict[str, str]:
    """sha256 of what the export wrote: the .gguf file, or every safetensors file of a compressed-tensors folder."""
    files = [out] if out.is_file() else sorted(out.rglob("*.safetensors"))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/gptq-torchrun"))
    ap.add_argument("--to", default="compressed-tensors")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64, help="64: divides smollm2-135m's 576 (compressed-tensors' default 128 does not)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    res = {}
    cmd = ["export", "smollm2-135m", "--to", args.to, "--bits", str(args.bits), "--group-size", str(args.group_size), "--quant", "gptq"]
    for name, out, wall in run_arms(args.work, lambda out: [*cmd, "--out", str(out)]):
        res[name] = {"wall_s": wall, "digest": digest(out), "load": os.getloadavg()[0]}
        print(f"  wall {wall:.0f} s (load {res[name]['load']:.1f})", flush=True)
    a2, a1, b = res.values()
    same = bool(a1["digest"]) and a1["digest"] == b["digest"]
    lines = ["# GPTQ export: 1 process vs 2 torchrun processes (gloo), smollm2-135m", "",
             f"Command: `python bench/bench_gptq_torchrun.py {' '.join(sys.argv[1:])}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `export --to {args.to} --bits {args.bits} --group-size {args.group_size} --quant gptq`.", "",
             "| run | wall s | load at end |", "|---|---:|---:|"]
    lines += [f"| {n} | {r['wall_s']:.0f} | {r['load']:.1f} |" for n, r in res.items()]
    lines += ["", f"Files of 2 processes (1 thread each) equal to 1 process with 1 thread: **{'yes' if same else 'NO'}** "
              f"({len(b['digest'])} files, sha256); equal to 1 process with 2 threads: "
              f"{'yes' if a2['digest'] == b['digest'] else 'no (another reduction order in the Hessians)'}.",
              f"2 processes vs 1 process with 2 threads: {a2['wall_s'] / b['wall_s']:.2f}x; vs 1 thread: {a1['wall_s'] / b['wall_s']:.2f}x."]
    text = "\n".join(lines) + "\n"
    (args.work / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
