"""`--budget-minutes`: size a collapse search (tokens, population, walk) to a time budget.

A few candidates are timed on two calibration blocks of the real model (seconds per candidate-block, from
their first changed layer, as the search runs them), then a small cost model counts the candidate-blocks
each rung of a ladder of settings needs (search, selection on validation, the walk at one layer count,
the coefficient tuning, the references) and the largest rung predicted to fit is chosen. The prediction is
rough (the search's prefix sharing and racing are taken at the rates bench/bench_collapse.py --speed
measured); the run report states the settings, the measured speed and the predicted time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# smallest first; each rung at least as large as the one before in every field
LADDER: tuple[dict, ...] = (
    dict(calib_tokens=2048, val_tokens=2048, population=8, generations=2, refine_steps=1, refine_screen_blocks=2, refine_top=2, tune_steps=16),
    dict(calib_tokens=4096, val_tokens=4096, population=8, generations=3, refine_steps=1, refine_screen_blocks=4, refine_top=4, tune_steps=32),
    dict(calib_tokens=6144, val_tokens=8192, population=8, generations=4, refine_steps=2, refine_screen_blocks=4, refine_top=4, tune_steps=48),
    dict(calib_tokens=8192, val_tokens=16384, population=8, generations=4, refine_steps=4, refine_screen_blocks=4, refine_top=4, tune_steps=48),
    dict(calib_tokens=8192, val_tokens=16384, population=12, generations=6, refine_steps=4, refine_screen_blocks=4, refine_top=4, tune_steps=48),
    dict(calib_tokens=16384, val_tokens=16384, population=16, generations=8, refine_steps=6, refine_screen_blocks=4, refine_top=4, tune_steps=64),
)
SEARCH_SHARE = 0.7  # fraction of a candidate's suffix the search runs with prefix states and racing (bench --speed)
WALK_SHARE = 0.6  # the same for a walk's neighbours, which share long prefixes with the incumbent


@dataclass
class Plan:
    settings: dict
    predicted_s: float
    sec_per_block: float
    budget_s: float

    def describe(self) -> str:
        s = self.settings
        return (f"--budget-minutes {self.budget_s / 60:g}: measured {self.sec_per_block:.3f} s per candidate-block; chose "
                f"{s['calib_tokens']} calibration / {s['val_tokens']} validation tokens, population {s['population']}, "
                f"{s['generations']} generations, walk {s['refine_steps']}/{s['refine_screen_blocks']}/{s['refine_top']}, "
                f"{s['tune_steps']} tuning steps (predicted {self.predicted_s / 60:.1f} min before the final quality measures)")


def predict_seconds(s: dict, sec_per_block: float, *, n_layers: int, seq_len: int, pareto: bool, gelaco: bool, batch: int = 4) -> float:
    """Predicted seconds of a search with settings `s` (pure: a cost model in candidate-blocks)."""
    n_cal, n_val = s["calib_tokens"] // seq_len, s["val_tokens"] // seq_len
    seeds = 10
    search = (s["population"] * (s["generations"] + 1) + seeds) * n_cal * SEARCH_SHARE
    counts = max(1, n_layers // 2) if pareto else 1
    select = counts * 2 * n_val
    target = round(0.73 * n_layers)
    removed, kept = n_layers - target, max(1, target - 2)
    swaps = removed * kept
    alphas = removed * 3 * 4 if gelaco else 0
    phases = [swaps] + ([swaps + alphas] if gelaco else [])
    walk = sum(s["refine_steps"] * (nb * s["refine_screen_blocks"] + s["refine_top"] * n_cal + n_val) for nb in phases) * WALK_SHARE
    tune = s["tune_steps"] * 3 * batch if gelaco else 0
    refs = 2 * (n_cal + n_val)
    return (search + select + walk + tune + refs) * sec_per_block


def choose(minutes: float, sec_per_block: float, **kw) -> Plan:
    """The largest rung of LADDER predicted to fit `minutes` (the smallest when none does)."""
    budget = minutes * 60.0
    best = LADDER[0]
    for rung in LADDER:
        if predict_seconds(rung, sec_per_block, **kw) <= budget:
            best = rung
    return Plan(dict(best), predict_seconds(best, sec_per_block, **kw), sec_per_block, budget)


def measure(lm, cfg, n_cands: int = 3, runner=None) -> float:
    """Seconds per candidate-block on this machine: a few drop candidates timed on two calibration blocks."""
    import dataclasses

    from llmcompress.collapse.fitness import prepare
    from llmcompress.collapse.space import Candidate

    small = dataclasses.replace(cfg, calib_tokens=2 * cfg.seq_len, val_tokens=cfg.seq_len, prefix_cache_gb=0.0)
    ev = prepare(small, lm, runner=runner)
    try:
        L = ev.n_layers
        pos = sorted({max(1, min(L - 1, round(L * f))) for f in (0.45, 0.55, 0.65)[:n_cands]})
        cands = [Candidate.from_keep(L, {i}) for i in pos]
        ev.evaluate(cands[0])  # warm-up (first-call allocations)
        ev.memo.clear()
        t0 = time.perf_counter()
        for c in cands:
            ev.evaluate(c)
        secs = time.perf_counter() - t0
        first = sum(c.groups[c.first_changed()][0] for c in cands) / len(cands)
        # the timed candidates start at mid-depth; the search's start at ~0.4 of the depth on average
        return secs / (len(cands) * ev.refs["calib"].n_blocks) * (L - 0.4 * L) / (L - first)
    finally:
        ev.close()
