"""Does a mixed-precision allocation beat uniform 4 bits on smollm2-135m once GPTQ is applied? (nas study)

`llmcompress nas` exports the uniform 4-bit plan at `--target-bits 4` because its validated last step finds
no searched plan with a lower held-out KL. This script checks that answer independently of the search, by
measurement with the exporter's own quantizer:

1. GPTQ (act-order, static groups, Hessians from the search's 128 calibration blocks) weights of every linear
   at each bit width of --bits;
2. the KL to the teacher of each unit (a layer's attention q/k/v/o, or its MLP gate/up/down) quantized alone
   at each bit width, on --measure-blocks calibration blocks;
3. the best allocation under the average-bits budget for each bit set of --sets, assuming the units' KLs add
   (Lagrangian knapsack, then leftover budget spent greedily);
4. side by side against uniform 4 bits: KL on the 32 held-out calibration blocks the nas refine step uses, and
   WikiText-2 raw test perplexity (first --eval-tokens tokens, seq-len 512).

    .venv/bin/python bench/bench_nas_alloc.py [--measure-blocks 8] [--eval-tokens 32768] [--work /tmp/llmc-nas-alloc]

GPTQ weights and the measured table are cached under --work (delete it to remeasure).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

GROUPS = {"attn": [0, 1, 2, 3], "mlp": [4, 5, 6]}  # indices into space.linears


def knapsack(table: dict, numel: dict, units: list, bits: list[int], avg_bits: float) -> tuple[dict, float]:
    """Allocation unit -> bits minimizing sum of table[unit][bits] with mean bits (weighted by numel) <= avg_bits."""
    budget = avg_bits * sum(numel[u] for u in units)

    def pick(lam):
        ch = {u: min(bits, key=lambda b: table[u][b] + lam * numel[u] * b) for u in units}
        return ch, sum(numel[u] * b for u, b in ch.items())

    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pick(mid)[1] > budget else (lo, mid)
    ch, used = pick(hi)
    while True:  # leftover budget, best KL gain per bit first
        best = None
        for u, b in ch.items():
            for nb in bits:
                if nb > b and used + numel[u] * (nb - b) <= budget:
                    gain = (table[u][b] - table[u][nb]) / (numel[u] * (nb - b))
                    if gain > 0 and (best is None or gain > best[0]):
                        best = (gain, u, nb)
        if best is None:
            break
        used += numel[best[1]] * (best[2] - ch[best[1]])
        ch[best[1]] = best[2]
    return ch, used / sum(numel[u] for u in units)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="3,4,5,6,8")
    ap.add_argument("--sets", default="3,4,8;3,4,5,6,8", help="bit sets to allocate from, ';'-separated")
    ap.add_argument("--measure-blocks", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmc-nas-alloc"))
    a = ap.parse_args()
    import torch

    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model
    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.pipeline import search_blocks
    from llmcompress.nas.sensitivity import mean_kl, reference_logp
    from llmcompress.nas.space import build_space
    from llmcompress.quant.apply import QuantizedWeight
    from llmcompress.quant.gptq import gptq_quantize, input_hessians

    torch.manual_seed(0)
    a.work.mkdir(parents=True, exist_ok=True)
    bits = [int(x) for x in a.bits.split(",")]
    cfg = NasConfig(target_bits=4.0, target_latency=0.6)  # the nas defaults: group size 64, 128 GPTQ blocks
    lm = load_model(cfg.model)
    model, tok = lm.model, lm.tokenizer
    space = build_space(model, cfg)
    blocks, held = search_blocks(tok, cfg)
    t0 = time.time()
    fqns = [space.fqn(i, n) for i in range(space.n_layers) for n in space.linears]
    mods = dict(model.named_modules())
    wpath = a.work / f"gptq_{'-'.join(map(str, bits))}.pt"
    if wpath.exists():
        wq = torch.load(wpath, weights_only=True)
    else:
        H = input_hessians(model, fqns, blocks[: cfg.gptq_blocks])
        wq = {}
        for b in bits:
            for f in fqns:
                W = mods[f].weight.data
                q, s, z = gptq_quantize(W, H[f], b, space.group_size, act_order=True)
                wq[(f, b)] = QuantizedWeight(q, s, z, b, space.group_size).dequantize(W.dtype)
            print(f"GPTQ {b} bits done, {time.time() - t0:.0f}s", flush=True)
        del H
        torch.save(wq, wpath)
    meas = blocks[: a.measure_blocks]

    @contextmanager
    def swapped(choice: dict):
        """The model with unit (layer, group) -> GPTQ weights at `bits` swapped in; restored on exit."""
        fs = {space.fqn(i, space.linears[j]): b for (i, g), b in choice.items() for j in GROUPS[g]}
        saved = {f: mods[f].weight.detach().clone() for f in fs}
        with torch.no_grad():
            for f, b in fs.items():
                mods[f].weight.copy_(wq[(f, b)])
        try:
            yield
        finally:
            with torch.no_grad():
                for f, s in saved.items():
                    mods[f].weight.copy_(s)

    tpath = a.work / f"table_{'-'.join(map(str, bits))}_{a.measure_blocks}.json"
    if tpath.exists():
        raw = json.loads(tpath.read_text())
    else:
        ref = reference_logp(model, meas)
        raw = {}
        for i in range(space.n_layers):
            for g in GROUPS:
                for b in bits:
                    with swapped({(i, g): b}):
                        raw[f"{i}.{g}.{b}"] = mean_kl(model, meas, ref)
            print(f"layer {i} measured, {time.time() - t0:.0f}s", flush=True)
        tpath.write_text(json.dumps(raw))
    units = [(i, g) for i in range(space.n_layers) for g in GROUPS]
    table = {u: {b: raw[f"{u[0]}.{u[1]}.{b}"] for b in bits} for u in units}
    numel = {u: sum(space.shapes[space.linears[j]][0] * space.shapes[space.linears[j]][1] for j in GROUPS[u[1]]) for u in units}
    ref_h = reference_logp(model, held)

    def evaluate(choice: dict) -> tuple[float, float]:
        with swapped(choice):
            return mean_kl(model, held, ref_h), perplexity(model, tok, "wikitext2", seq_len=512, max_tokens=a.eval_tokens)["ppl"]

    uni = {u: 4 for u in units}
    rows = [("uniform 4", uni, 4.0, evaluate(uni))]
    for s in a.sets.split(";"):
        bs = sorted(int(x) for x in s.split(","))
        ch, avg = knapsack(table, numel, units, bs, 4.0)
        rows.append((f"knapsack {{{','.join(map(str, bs))}}}", ch, avg, evaluate(ch) if ch != uni else rows[0][3]))
    lines = [f"## Allocation study ({time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} CPU cores, {(time.time() - t0) / 60:.1f} min)", "",
             f"Command: `python bench/bench_nas_alloc.py --bits {a.bits} --sets '{a.sets}' --measure-blocks {a.measure_blocks} "
             f"--eval-tokens {a.eval_tokens}`", "",
             "| plan | avg bits | predicted KL (sum of units) | held-out KL | WikiText-2 ppl | ppl / uniform | units not at 4 bits |",
             "|---|---|---|---|---|---|---|"]
    for name, ch, avg, (kl, ppl) in rows:
        pred = sum(table[u][b] for u, b in ch.items())
        diff = ", ".join(f"{i}.{g}:{b}" for (i, g), b in ch.items() if b != 4) or "none"
        lines.append(f"| {name} | {avg:.3f} | {pred:.4f} | {kl:.4f} | {ppl:.2f} | {ppl / rows[0][3][1]:.3f} | {diff} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "RESULTS-nas-alloc.md"
    intro = "\n\n".join(__doc__.split("\n\n")[1:3])
    head = out.read_text() if out.is_file() else f"# nas: mixed-precision allocation vs uniform 4 bits (GPTQ)\n\nGenerated by `bench/bench_nas_alloc.py`. {intro}\n\n"
    out.write_text(head + text + "\n")


if __name__ == "__main__":
    main()
