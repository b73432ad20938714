"""Candidates scored by several processes: under torchrun each rank scores a slice of every batch of candidates
(a generation's offspring, a walk's neighbours) and the results are all-gathered into every rank's evaluator.

Fitness values do not depend on which process computed them (the same model, data and arithmetic on every
rank; a pruned evaluation stops at the same batch on every rank because its racing rule depends only on the
parents), so every rank holds the same memo and archive, and the search, the selection and the walk take
the same decisions as one process: the front is identical bit for bit (tests/test_collapse_speed.py). Only
rank 0 writes files. Single process stays the default; torch.distributed is joined only under torchrun.
"""

from __future__ import annotations

from llmcompress.dist import world


def evaluate_many(ev, cands: list, split: str = "calib", prune_for=None, on_result=None) -> list:
    """Fitness of every candidate on `split`, split over the ranks (one process: in order, here).

    Args:
        ev: the Evaluator (its memo, partial sums and archive receive every rank's results).
        prune_for: callable(candidate) -> racing rule for Evaluator.evaluate (or None).
        on_result: callable(Fitness) after each evaluation this process makes (a racing rule may learn from it).
    """
    info = world()
    rule = prune_for or (lambda c: None)

    def one(c):
        fit = ev.evaluate(c, split, rule(c))
        if on_result is not None:
            on_result(fit)
        return fit

    if not info.active:
        return [one(c) for c in cands]
    import torch.distributed as dist

    if split == "calib":  # the archive's order (selection breaks ties by it) is the candidates' order on every rank
        for c in cands:
            ev.archive[c.key] = c
    mine = []
    for i in range(info.rank, len(cands), info.world_size):
        fit = one(cands[i])
        mine.append((i, fit, ev.partial.get((split, cands[i].key))))
    parts: list = [None] * info.world_size
    dist.all_gather_object(parts, mine)
    out: list = [None] * len(cands)
    for part in parts:
        for i, fit, partial in part:
            key = (split, cands[i].key)
            out[i] = fit
            if split == "calib":
                ev.archive[cands[i].key] = cands[i]
            if fit.partial:
                ev.partial[key] = partial
            else:
                ev.memo[key] = fit
                ev.partial.pop(key, None)
    return out


__all__ = ["evaluate_many"]
