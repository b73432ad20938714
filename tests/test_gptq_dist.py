"""GPTQ spread over torch.distributed ranks (quant/gptq.py): every rank runs each layer's forward and Hessians,
quantizes its share of the layer's linears (`assign_linears`) and the integers are all-gathered. Two gloo
processes give the integers of one process bit for bit, each rank quantizing only part of the linears, and
`torchrun -m llmcompress export --quant gptq` writes from rank 0 the files one process writes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmcompress.quant.gptq import assign_linears

SHAPES = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64), "down": (64, 128)}


def _cost(f):
    out, inp = SHAPES[f]
    return inp**3 + out * inp**2


def test_assign_linears_gives_every_linear_to_one_rank_and_balances_the_cost():
    for world in (1, 2, 3, 7, 9):
        parts = assign_linears(SHAPES, world)
        assert len(parts) == world and parts == assign_linears(SHAPES, world)  # deterministic: every rank agrees
        assert sorted(f for p in parts for f in p) == sorted(SHAPES)
    loads = [sum(_cost(f) for f in p) for p in assign_linears(SHAPES, 2)]
    # the MLP's down projection alone is ~half the work: round robin over the planned order would give one rank 74%
    assert max(loads) <= 0.55 * sum(loads)


WORKER = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import torch.distributed as dist
dist.init_process_group("gloo")
from conftest import TINY_VOCAB, tiny_model
import llmcompress.quant.gptq as G
from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

calls = []
real = G.gptq_quantize
def counted(W, H, *a, **k):
    calls.append(tuple(W.shape))
    return real(W, H, *a, **k)
G.gptq_quantize = counted
model = tiny_model("llama", layers=3)
plan = MixedPrecisionPlan()
for n, m in model.named_modules():
    if isinstance(m, torch.nn.Linear) and ".layers." in n:
        plan[n] = QuantConfig(bits=3, group_size=16, sym={sym})
plan["_default"] = None
ids = torch.randint(3, TINY_VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
q = G.gptq_model_(model, plan, ids, progress=False, act_order=True)
digest = {{f: hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in (w.q, w.scale, w.zero))).hexdigest()
          for f, w in sorted(q.items())}}
weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
with open({out!r} + f"/r{{dist.get_rank()}}.json", "w") as f:
    json.dump(dict(digest=digest, weights=weights, calls=len(calls)), f)
dist.destroy_process_group()
"""


def _torchrun(args, world: int, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.dist
def test_two_gloo_processes_give_the_single_process_integers(tmp_path, sym=False):
    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", LLMCOMPRESS_PROGRESS="0")
    res = {}
    for name, world in (("one", 1), ("two", 2)):
        (tmp_path / name).mkdir()
        script = tmp_path / name / "worker.py"
        script.write_text(WORKER.format(tests=tests, out=str(tmp_path / name), sym=sym))
        r = _torchrun([str(script)], world, env)
        assert r.returncode == 0, r.stderr[-3000:]
        res[name] = [json.loads((tmp_path / name / f"r{k}.json").read_text()) for k in range(world)]
    (one,), two = res["one"], res["two"]
    assert len(one["digest"]) == one["calls"] == 21  # 3 layers x 7 linears
    for r in two:  # every rank ends with every integer and the dequantized weights, as one process
        assert r["digest"] == one["digest"] and r["weights"] == one["weights"]
    assert sum(r["calls"] for r in two) == one["calls"] and max(r["calls"] for r in two) < one["calls"]


def _tree_digest(path: Path) -> dict[str, str]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.suffix == ".safetensors":
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.dist
def test_export_under_torchrun_writes_the_single_process_files(tmp_path, tiny_hf_dir):
    """`torchrun --nproc-per-node 2 -m llmcompress export --quant gptq`, in memory and streamed (`--max-memory 0`), and
    with RTN (nothing to spread: rank 0 alone): rank 0 writes the tensors one process writes, and prints once."""
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 60 + "\n\n") * 40)
    env = dict(os.environ, OMP_NUM_THREADS="1", LLMCOMPRESS_PROGRESS="0")
    for tag, extra in (("mem", ["--quant", "gptq"]), ("stream", ["--quant", "gptq", "--max-memory", "0"]), ("rtn", ["--quant", "rtn"])):
        args = ["-m", "llmcompress", "export", str(tiny_hf_dir), "--to", "compressed-tensors", "--bits", "4",
                "--group-size", "32", "--calib-data", str(text), *extra]
        one = subprocess.run([sys.executable, *args, "--out", str(tmp_path / f"one-{tag}")], capture_output=True, text=True,
                             env=env, timeout=300)
        assert one.returncode == 0, one.stderr[-3000:]
        two = _torchrun([*args, "--out", str(tmp_path / f"two-{tag}")], 2, env)
        assert two.returncode == 0, two.stderr[-3000:]
        a, b = _tree_digest(tmp_path / f"one-{tag}"), _tree_digest(tmp_path / f"two-{tag}")
        assert a and a == b, tag
        assert two.stdout.count("wrote ") == 1 == one.stdout.count("wrote ")
