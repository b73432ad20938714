"""Baselines on the same evaluator: ShortGPT (Block Influence) and LaCo (greedy RDSC merging).

Both return candidates in the collapse encoding, so they are scored, plotted and seeded like search results.
"""

from __future__ import annotations

from llmcompress.collapse.config import KINDS
from llmcompress.collapse.fitness import Evaluator, block_influence
from llmcompress.collapse.space import Candidate


def identity(n_layers: int) -> Candidate:
    return Candidate(tuple((i,) for i in range(n_layers)), tuple(() for _ in range(n_layers)))


def shortgpt_scores(evaluator: Evaluator) -> list[float]:
    """Block Influence of every layer on the calibration states (cached states: no extra forward; a spilled
    store is read one boundary at a time)."""
    return block_influence(iter(evaluator.refs["calib"].states))


def shortgpt(evaluator: Evaluator, n_keep: int, scores: list[float] | None = None) -> Candidate:
    """Drop the layers with the lowest Block Influence (layer 0 always stays: it leads the first group)."""
    scores = scores if scores is not None else shortgpt_scores(evaluator)
    L = evaluator.n_layers
    order = sorted(range(1, L), key=lambda i: scores[i])
    return Candidate.from_keep(L, set(order[: L - n_keep]))


def merge_groups(cand: Candidate, i: int, n: int) -> Candidate:
    """Merge groups i..i+n-1 into one with RDSC (alpha = 1 for every merged layer, relative to the leader)."""
    groups = list(cand.groups)
    alphas = list(cand.alphas)
    merged = tuple(layer for grp in groups[i : i + n] for layer in grp)
    one = tuple(1.0 for _ in KINDS)
    groups[i : i + n] = [merged]
    alphas[i : i + n] = [tuple(one for _ in merged[1:])]
    return Candidate(tuple(groups), tuple(alphas))


def laco(
    evaluator: Evaluator,
    min_layers: int,
    *,
    merge: int = 3,
    threshold: float = 0.95,
    n_blocks: int = 4,
    protect_first: int = 1,
    protect_last: int = 1,
    max_passes: int = 6,
    relax: float = 0.05,
    max_tokens: int = 128,
) -> dict[int, Candidate]:
    """LaCo (Yang et al., 2024), a faithful small version: top-down greedy RDSC merges with a similarity check.

    From the top layer down, merge layer l with the following `merge - 1` layers; keep the merge when the
    merged model's last hidden states stay cosine-similar (> threshold) to the original's on a few
    calibration blocks (first `max_tokens` positions), then continue below the merged layer; else move one layer
    down. When a pass ends above `min_layers`, the threshold is relaxed by `relax` and another pass runs on
    the current model. A pass that accepts nothing (on small models, 3-layer RDSC merges fall far below any
    usual threshold) instead merges the two leading groups of its most similar trial (one layer fewer),
    so the baseline passes through every layer count and can be compared at equal budgets.

    Returns:
        layer count -> candidate, for every count the greedy sequence passes through.
    """
    L = evaluator.n_layers
    cand = identity(L)
    out: dict[int, Candidate] = {}
    t = threshold
    for _ in range(max_passes + L):
        g = len(cand.groups) - protect_last - 1
        accepted, best = False, None
        while g >= protect_first and cand.n_layers > min_layers:
            n = min(merge, cand.n_layers - min_layers + 1, len(cand.groups) - protect_last - g)
            if n < 2:
                g -= 1
                continue
            trial = merge_groups(cand, g, n)
            sim = evaluator.final_similarity(trial, n_blocks, max_tokens=max_tokens)
            if sim > t:
                cand, accepted = trial, True
                out[cand.n_layers] = cand
            elif best is None or sim > best[0]:
                best = (sim, g)
            g -= 1  # accepted: the merged group sits at g, continue below it; rejected: move one down
        if cand.n_layers <= min_layers:
            break
        if not accepted and best is not None:
            cand = merge_groups(cand, best[1], 2)  # one layer at a time, so every budget is visited
            out[cand.n_layers] = cand
        t -= relax
    return out
