"""Validated refinement of the derived architecture: a (1+1) local search on the measured KL.

The gradient search and the sensitivity proxy only estimate what a discrete plan costs in quality (the
proxy adds per-layer errors that compound in reality). The last step of a
search therefore measures it, on calibration blocks the search never trained on:

1. every start candidate (the search's derived architecture and, for `joint`, the uniform plan when it
   lies in the space and meets the targets) is scored by the KL of the quantized model (the bank's
   weights, nas/qbank.py: the ones the export ships) against the teacher;
2. from the best of them, `evals` times: a level-switch mutation (`mutate`: raise one choice by a level,
   lower random others of the same kind until every target holds again, then spend what is left with
   the logits' greedy upgrade) is scored the same way and kept when its KL is lower (EvoPress-style).

So the exported plan is never worse, on held-out calibration data, than any start candidate, and every
accepted change was measured rather than predicted. Pure parts (`mutate`, `same_arch`) are separate from
the model-running parts (`arch_kl`, `refine`; the KL helpers are sensitivity's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcompress.nas.sensitivity import mean_kl, reference_logp
from llmcompress.nas.space import Arch, SearchSpace, apply_move, down_moves, up_moves, upgrade, violation

if TYPE_CHECKING:
    import torch

    from llmcompress.nas.supernet import Supernet


QUANT_KINDS = {"bits", "head"}


def same_arch(a: Arch, b: Arch) -> bool:
    return a.keep == b.keep and a.width == b.width and a.bits == b.bits and a.head == b.head


def mutate(space: SearchSpace, arch: Arch, costs, targets: dict[str, float], rng: random.Random,
           kinds: set[str] | None = None, logits: dict | None = None) -> Arch | None:
    """One level-switch neighbour of `arch` that meets `targets`, or None when there is none.

    Raises one random choice of an allowed kind ("bits", "width", "skip") by one level, lowers random
    other choices of the same kind by one level until the targets hold, then greedily spends any budget
    left (space.upgrade with `logits`; upgrade never breaks a target).
    """
    kinds = kinds or {"bits", "width", "skip", "head"}
    ups = [m for m in up_moves(space, arch) if m[0] in kinds]
    if not ups:
        return None
    up = rng.choice(ups)
    new = apply_move(arch, up, +1)
    touched = {up}
    while violation(costs.metrics(new), targets) > 1e-9:
        group = QUANT_KINDS if up[0] in QUANT_KINDS else {up[0]}  # the head's bits trade against linears' bits
        downs = [m for m in down_moves(space, new) if m[0] in group & kinds and m not in touched]
        if not downs:
            return None
        down = rng.choice(downs)
        new = apply_move(new, down, -1)
        touched.add(down)
    new = upgrade(space, new, logits, costs, targets, kinds) if logits is not None else new
    return None if same_arch(new, arch) else new


def arch_kl(model, net: Supernet, arch: Arch, blocks: torch.Tensor, ref: list[torch.Tensor], batch: int = 2) -> float:
    """Mean per-token KL(teacher || `arch` with the bank's weights, the head included) on `blocks`; `net` is restored."""
    with net.pinned(arch):
        return mean_kl(model, blocks, ref, batch)


@dataclass
class RefineResult:
    arch: Arch
    kl: float
    start: str
    start_kl: dict[str, float]
    accepted: int = 0
    evaluated: int = 0
    history: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"start": self.start, "start_kl": self.start_kl, "final_kl": self.kl, "evaluated": self.evaluated,
                "accepted": self.accepted}


def refine(model, net: Supernet, space: SearchSpace, costs, targets: dict[str, float], starts: dict[str, Arch],
           blocks: torch.Tensor, *, evals: int, seed: int, kinds: set[str] | None = None, logits: dict | None = None,
           log=None) -> RefineResult:
    """Best start candidate by measured KL on `blocks`, then `evals` level-switch mutations kept when better.

    Args:
        starts: name -> architecture (each must meet `targets`; those that do not are skipped).
        kinds: choice kinds the mutations may change (sequential: {"bits"}: its architecture is fixed).
        logits: the search's logits, used only to spend leftover budget after a mutation.
        log: callable(record) for one line per evaluation (search_log.jsonl).
    """
    from llmcompress.progress import bar

    ref = reference_logp(model, blocks)
    start_kl: dict[str, float] = {}
    for name, a in starts.items():
        if a is None or violation(costs.metrics(a), targets) > 1e-9:
            continue
        same = next((n for n in start_kl if same_arch(starts[n], a)), None)  # e.g. the search derived uniform
        start_kl[name] = start_kl[same] if same is not None else arch_kl(model, net, a, blocks, ref)
    name = min(start_kl, key=start_kl.__getitem__)  # ties: the first listed (the search's own)
    res = RefineResult(starts[name].copy(), start_kl[name], name, start_kl)
    if log:
        for n, v in start_kl.items():
            log({"stage": "refine", "candidate": n, "kl": v, "chosen": n == name})
    rng = random.Random(seed)
    seen: list[Arch] = [res.arch]
    with bar("refine (measured KL)", total=evals) as b:
        for step in range(evals):
            cand = None
            for _ in range(20):  # a neighbour not evaluated yet
                c = mutate(space, res.arch, costs, targets, rng, kinds, logits)
                if c is not None and not any(same_arch(c, s) for s in seen):
                    cand = c
                    break
            if cand is None:
                b.advance()
                continue
            seen.append(cand)
            kl = arch_kl(model, net, cand, blocks, ref)
            res.evaluated += 1
            better = kl < res.kl
            if better:
                res.arch, res.kl = cand, kl
                res.accepted += 1
            rec = {"stage": "refine", "step": step + 1, "kl": kl, "best_kl": res.kl, "accepted": better}
            res.history.append(rec)
            if log:
                log(rec)
            b.advance(info=f"kl={kl:.4f} best={res.kl:.4f}")
    return res


__all__ = ["RefineResult", "arch_kl", "mutate", "refine", "same_arch"]
