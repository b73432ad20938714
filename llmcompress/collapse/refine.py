"""Local refinement at a fixed layer count: swap moves with racing (EvoPress-style multi-step selection).

A small population rarely improves on a good seed at a fixed budget: most offspring of ShortGPT's drop
set are far worse, so the GA spends its evaluations on them. Refinement walks the neighbourhood of the
best solution instead. One move restores one absorbed layer (it leads its own group again) and absorbs
one leading layer into the group before it (alpha 0: dropped), so the layer count stays the same; for a
drop-only candidate this is the swap of one dropped layer with one kept layer. Where alpha is free
(gelaco, not drop-search) a move may instead change one merge coefficient: one absorbed layer, one module
kind, another value of the grid (measured on smollm2-135m at 22 layers: from the best drop set, putting
layer 18's MLP back at alpha 0.75 into the layer that leads its group lowered validation KL 1.035 -> 1.013).

The walk has two phases: swap moves only until a local optimum (or `steps` moves), then, where alpha is
free, swaps and coefficient changes together (again up to `steps` moves). A gelaco walk from the same
start as a drop-search walk therefore passes through the drop-search walk's end point and can only go
lower on calibration from there.

Each step scores every neighbour on a few calibration blocks (the *screen*, a prefix of the calibration
split), evaluates the `top` best on the whole calibration split, and moves to the best of those if it
beats the incumbent there. Each phase stops at a local optimum or after `steps` moves. The solution
returned is the point of the walk with the best *validation* fitness (the search never optimizes on it),
so a walk that starts to overfit its calibration tokens gives back its earlier point.

The walk is deterministic (neighbours in a fixed order, ties broken by it) and its trajectory is written
atomically after every move, so a resumed run continues it and ends where an uninterrupted one ends.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmcompress.collapse.fitness import Evaluator, Reference
from llmcompress.collapse.parallel import evaluate_many
from llmcompress.collapse.space import Candidate, Space
from llmcompress.dist import is_main

SCREEN = "screen"
STATE_FILE = "refine_state.json"


# ---------------------------------------------------------------- pure functions


def group_sizes(bits: np.ndarray) -> list[int]:
    """Group sizes of a cut vector (bits[i] = 1: layer i + 1 leads a new group)."""
    sizes, cur = [], 1
    for b in bits:
        if b:
            sizes.append(cur)
            cur = 1
        else:
            cur += 1
    sizes.append(cur)
    return sizes


def swap_neighbours(space: Space, x: np.ndarray) -> list[np.ndarray]:
    """Genomes one swap away from `x` at the same layer count, in a fixed order.

    Restore layer i + 1 (set cut bit i) and absorb layer j + 1 into the group before it with alpha 0 (clear
    cut bit j), for every unprotected pair; pairs that break `max_group` are left out.
    """
    L = space.n_layers
    x = np.asarray(x).astype(int)
    bits = x[: L - 1]
    protected = space.protected_bits()
    zero = int(np.argmin(np.abs(np.asarray(space.alpha_grid) - 0.0)))
    nk = space.n_kinds
    restore = [i for i in range(L - 1) if not bits[i] and not protected[i]]
    absorb = [j for j in range(L - 1) if bits[j] and not protected[j]]
    out = []
    for i in restore:
        for j in absorb:
            y = x.copy()
            y[i], y[j] = 1, 0
            y[L - 1 + (j + 1) * nk : L - 1 + (j + 2) * nk] = zero
            if max(group_sizes(y[: L - 1])) <= space.max_group:
                out.append(y)
    return out


def alpha_neighbours(space: Space, x: np.ndarray) -> list[np.ndarray]:
    """Genomes one merge-coefficient change away from `x`: one absorbed layer, one module kind, another grid
    value (none when the space fixes alpha, as drop-search does). Same partition, same layer count."""
    if space.fixed_alpha is not None:
        return []
    L = space.n_layers
    x = np.asarray(x).astype(int)
    bits, nk = x[: L - 1], space.n_kinds
    out = []
    for layer in range(1, L):
        if bits[layer - 1]:
            continue  # a leader: its genes are unused
        for k in range(nk):
            gene = L - 1 + layer * nk + k
            for v in range(len(space.alpha_grid)):
                if v != x[gene]:
                    y = x.copy()
                    y[gene] = v
                    out.append(y)
    return out


def neighbours(space: Space, x: np.ndarray) -> list[np.ndarray]:
    """Every move of the walk: swaps, then merge-coefficient changes."""
    return swap_neighbours(space, x) + alpha_neighbours(space, x)


def candidate_to_json(c: Candidate) -> dict:
    return {"groups": [list(g) for g in c.groups], "alphas": [[list(a) for a in g] for g in c.alphas]}


def candidate_from_json(d: dict) -> Candidate:
    return Candidate(tuple(tuple(g) for g in d["groups"]), tuple(tuple(tuple(a) for a in g) for g in d["alphas"]))


# ---------------------------------------------------------------- the walk


@dataclass
class RefineResult:
    best: Candidate  # the point of the walk with the best validation fitness
    trajectory: list[Candidate]
    records: list[dict] = field(default_factory=list)
    local_optimum: bool = False


def add_screen(ev: Evaluator, blocks: int) -> None:
    """Register the screening split: the first `blocks` calibration blocks (views, no copy)."""
    calib = ev.refs["calib"]
    n = max(1, min(blocks, calib.n_blocks))
    if SCREEN in ev.refs and ev.refs[SCREEN].n_blocks == n:
        return
    ev.refs[SCREEN] = Reference(calib.blocks[:n], calib.states.first(n), calib.top_idx[:n], calib.top_logp[:n], calib.stride, "screen")
    ev.split_batch[SCREEN] = 1  # racing checks its bound after every block
    ev.memo = {k: v for k, v in ev.memo.items() if k[0] != SCREEN}


def screen(ev: Evaluator, neigh: list[Candidate], top: int) -> list:
    """Screening fitness of every neighbour, with racing: a neighbour whose lower bound is already worse than
    `top` fully screened ones cannot be among the `top` best and stops early (its value is then a lower
    bound; the `top` best and their order are exactly those of screening every neighbour in full)."""
    done: list[float] = []

    def rule(c):
        return lambda lb: len(done) >= top and lb > done[top - 1]

    def learn(fit):
        if not fit.partial:
            bisect.insort(done, fit.fitness)

    return evaluate_many(ev, neigh, SCREEN, rule, on_result=learn)


def load_entry(path: Path | None, key: str) -> dict | None:
    """The entry `key` of a JSON state file (None when the file or the entry is missing or unreadable)."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None


def save_entry(path: Path | None, key: str, entry: dict) -> None:
    """Set entry `key` of a JSON state file, written atomically (None: keep nothing; under torchrun, rank 0 writes)."""
    if path is None or not is_main():
        return
    from llmcompress.io.atomic import write_json

    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    write_json(path, data)


def refine(
    ev: Evaluator,
    space: Space,
    start: Candidate,
    *,
    steps: int,
    screen_blocks: int = 4,
    top: int = 4,
    state_path: Path | None = None,
    on_step=None,
) -> RefineResult:
    """Walk from `start` by swap, then swap and coefficient, moves with racing (see the module docstring).

    Args:
        ev: the evaluator (its calibration split decides the moves, its validation split the result).
        space: the search space (protected layers, max_group, alpha grid).
        steps: most moves per phase (0: return `start`).
        screen_blocks: calibration blocks every neighbour is screened on.
        top: neighbours per step evaluated on the whole calibration split.
        state_path: JSON file holding the trajectory per layer count (resume); None keeps nothing.
        on_step: callback(record) after each step.
    """
    key = str(start.n_layers)
    saved = load_entry(state_path, key) or {}
    trajectory = [candidate_from_json(c) for c in saved["trajectory"]] if saved else [start]
    records: list[dict] = list(saved.get("records", []))
    phases = ["swap"] + (["swap+alpha"] if space.fixed_alpha is None else [])
    phase, phase_start = int(saved.get("phase", 0)), int(saved.get("phase_start", 0))
    done = bool(saved.get("done"))
    local_opt = bool(saved.get("local_optimum"))

    def save(done_now: bool) -> None:
        save_entry(state_path, key, {"trajectory": [candidate_to_json(c) for c in trajectory], "records": records, "phase": phase,
                                "phase_start": phase_start, "done": done_now, "local_optimum": local_opt})

    if steps > 0 and not done:
        add_screen(ev, screen_blocks)
    while not done and phase < len(phases):
        inc = trajectory[-1]
        local_opt = False
        while len(trajectory) - 1 - phase_start < steps:
            moves = swap_neighbours(space, space.encode(inc)) if phases[phase] == "swap" else neighbours(space, space.encode(inc))
            neigh = [n for n in (space.decode(y) for y in moves) if n.key != inc.key]
            if not neigh:
                local_opt = True
                break
            ev.evaluate(inc, SCREEN)  # its prefix states: most neighbours share a long prefix with it
            screened = sorted((f.fitness, k) for k, f in enumerate(screen(ev, neigh, top)))
            tops = [k for _, k in screened[:top]]
            full = [(f.fitness, k) for k, f in zip(tops, evaluate_many(ev, [neigh[k] for k in tops]))]
            best_f, best_k = min(full)
            inc_f = ev.evaluate(inc).fitness
            rec = {"layers": inc.n_layers, "phase": phases[phase], "step": len(trajectory), "neighbours": len(neigh),
                   "fitness_calib": inc_f, "best_neighbour_calib": best_f, "moved": best_f < inc_f}
            if best_f >= inc_f:
                local_opt = True
                records.append(rec)
                if on_step is not None:
                    on_step(rec)
                break
            inc = neigh[best_k]
            trajectory.append(inc)
            rec.update(fitness_calib=best_f, fitness_val=ev.evaluate(inc, "val").fitness, changes=inc.describe())
            records.append(rec)
            save(False)
            if on_step is not None:
                on_step(rec)
        phase, phase_start = phase + 1, len(trajectory) - 1
        save(False)
    done = True
    save(True)
    best = min(trajectory, key=lambda c: (ev.evaluate(c, "val").fitness, trajectory.index(c)))
    return RefineResult(best, trajectory, records, local_opt)


__all__ = ["RefineResult", "add_screen", "load_entry", "save_entry", "alpha_neighbours", "neighbours", "candidate_from_json", "candidate_to_json", "group_sizes", "refine", "swap_neighbours"]
