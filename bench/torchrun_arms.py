"""The three arms of the torchrun benches (bench_collapse_torchrun.py, bench_gptq_torchrun.py): one `llmcompress`
command as 1 process with 2 torch threads (what a user runs without torchrun: the speed baseline), 1 process
with 1 thread, and `torchrun --nproc_per_node 2` with 1 thread per rank, each in its own output folder, timed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ONE = [sys.executable, "-m", "llmcompress"]
TWO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "llmcompress"]
ARMS = [("1 process, 2 threads", ONE, 2), ("1 process, 1 thread", ONE, 1), ("2 torchrun processes, 1 thread each", TWO, 1)]


def run_arms(work: Path, args_for: Callable[[Path], list[str]]) -> Iterator[tuple[str, Path, float]]:
    """Run `llmcompress <args_for(out)>` in every arm, one after the other; yields (arm, its out folder, wall s).
    Exits with the command's stderr when one fails."""
    for name, launcher, threads in ARMS:
        out = work / name.replace(" ", "-").replace(",", "")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*launcher, *args_for(out)]
        print(f"{name}: {' '.join(cmd)}", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), LLMCOMPRESS_PROGRESS="0")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        yield name, out, wall
