"""Refinement by swap moves with racing (collapse/refine.py) on a tiny model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import tiny_collapse_evaluator

from llmcompress.collapse.refine import (
    STATE_FILE,
    candidate_from_json,
    candidate_to_json,
    group_sizes,
    refine,
    swap_neighbours,
)
from llmcompress.collapse.space import Candidate, Space


def _evaluator(layers=10, seed=0):
    return tiny_collapse_evaluator(layers, seed=seed, data_seed=1)


def _space(L=10, n=7, **kw):
    return Space(L, (0.0, 0.5, 1.0), lo=n, hi=n, **kw)


def test_group_sizes():
    assert group_sizes(np.array([1, 0, 0, 1])) == [1, 3, 1]
    assert group_sizes(np.array([0, 0])) == [3]


def test_swap_neighbours_are_every_swap_of_a_drop_set():
    sp = _space()
    start = Candidate.from_keep(10, {3, 4, 7})
    neigh = [sp.decode(y) for y in swap_neighbours(sp, sp.encode(start))]
    drops = lambda c: frozenset(i for g in c.groups for i in g[1:])  # noqa: E731
    # restore one of the 3 dropped layers, drop one of the kept layers 2, 5, 6, 8 (layer 0 must stay a group of
    # one, so layer 1 leads a group; layer 9 is protected): every drop set at one swap's distance, none twice
    expected = {frozenset({3, 4, 7} - {a} | {b}) for a, b in itertools.product({3, 4, 7}, {2, 5, 6, 8})}
    got = [drops(c) for c in neigh]
    assert len(got) == len(set(got)) == len(expected) and set(got) == expected
    assert all(c.n_layers == 7 and c.groups[0] == (0,) and c.groups[-1] == (9,) for c in neigh)
    assert all(a == 0.0 for c in neigh for g in c.alphas for t in g for a in t)


def test_swap_neighbours_keep_merge_coefficients_and_max_group():
    sp = _space(max_group=2)
    x = sp.encode(Candidate.from_keep(10, {2, 5, 7}))
    x[9 + 5 * 3 : 9 + 6 * 3] = 2  # layer 5 merged into 4 with alpha 1
    start = sp.decode(x)
    for c in (sp.decode(y) for y in swap_neighbours(sp, x)):
        assert max(len(g) for g in c.groups) <= 2
        for g, grp in enumerate(c.groups):
            if len(grp) == 2 and grp[1] == 5 and grp[0] == 4:
                assert c.alphas[g][0] == (1.0, 1.0, 1.0)  # an untouched merge keeps its coefficients
    assert start.describe().count("merge") == 1


def test_candidate_json_roundtrip():
    sp = _space()
    x = sp.encode(Candidate.from_keep(10, {2, 5, 7}))
    x[9 + 5 * 3] = 1
    c = sp.decode(x)
    assert candidate_from_json(candidate_to_json(c)) == c


def test_refine_improves_a_bad_start_and_never_worsens():
    ev = _evaluator()
    sp = _space()
    # the worst single-layer removals make a poor start; the walk must find a better drop set
    solo = {i: ev.evaluate(Candidate.from_keep(10, {i})).fitness for i in range(1, 9)}
    bad = Candidate.from_keep(10, set(sorted(solo, key=solo.get)[-3:]))
    res = refine(ev, sp, bad, steps=3, screen_blocks=2, top=2)
    assert len(res.trajectory) >= 2, "no improving swap found from the worst drop set"
    fits = [ev.evaluate(c).fitness for c in res.trajectory]
    assert all(b < a for a, b in zip(fits, fits[1:]))  # every move lowers the calibration fitness
    assert res.best in res.trajectory
    assert ev.evaluate(res.best, "val").fitness == min(ev.evaluate(c, "val").fitness for c in res.trajectory)
    assert refine(ev, sp, bad, steps=0).best == bad


def test_refine_resumes_to_the_same_walk(tmp_path):
    import json

    sp = _space()
    start = Candidate.from_keep(10, {2, 3, 4})
    path = tmp_path / STATE_FILE
    full = refine(_evaluator(), sp, start, steps=3, screen_blocks=2, top=2, state_path=path)
    data = json.loads(path.read_text())["7"]
    assert data["done"] and len(full.trajectory) >= 3, "the walk should move in both phases from this start"
    for cut in range(1, len(full.trajectory)):  # interrupted after `cut` moves, in either phase
        n_swap = sum(1 for r in data["records"] if r["phase"] == "swap" and r["moved"])
        state = {"trajectory": data["trajectory"][: cut + 1], "records": data["records"][:cut], "done": False,
                 "phase": 1 if cut > n_swap else 0, "phase_start": n_swap if cut > n_swap else 0}
        (tmp_path / f"cut{cut}.json").write_text(json.dumps({"7": state}))
        resumed = refine(_evaluator(), sp, start, steps=3, screen_blocks=2, top=2, state_path=tmp_path / f"cut{cut}.json")
        assert resumed.trajectory == full.trajectory and resumed.best == full.best


@pytest.mark.parametrize("steps", [2])
def test_refine_is_deterministic(steps):
    sp = _space()
    start = Candidate.from_keep(10, {4, 5, 6})
    a = refine(_evaluator(), sp, start, steps=steps, screen_blocks=2, top=3)
    b = refine(_evaluator(), sp, start, steps=steps, screen_blocks=2, top=3)
    assert a.trajectory == b.trajectory


def test_alpha_neighbours_change_one_coefficient_and_only_where_alpha_is_free():
    from llmcompress.collapse.refine import alpha_neighbours

    sp = _space()
    start = Candidate.from_keep(10, {3, 7})
    x = sp.encode(start)
    neigh = [sp.decode(y) for y in alpha_neighbours(sp, x)]
    assert len(neigh) == 2 * 3 * 2  # 2 absorbed layers x 3 kinds x 2 other grid values
    for c in neigh:
        assert c.groups == start.groups
        diff = [(g, j, k) for g in range(len(c.groups)) for j in range(len(c.alphas[g])) for k in range(3)
                if c.alphas[g][j][k] != start.alphas[g][j][k]]
        assert len(diff) == 1
    assert alpha_neighbours(Space(10, (0.0, 0.5, 1.0), lo=8, hi=8, fixed_alpha=0.0), x) == []


def test_gelaco_walk_ends_no_higher_than_the_drop_search_walk_from_the_same_start():
    ev = _evaluator(seed=3)
    start = Candidate.from_keep(10, {2, 3, 4})
    drop = refine(ev, _space(fixed_alpha=0.0), start, steps=4, screen_blocks=2, top=2)
    free = refine(ev, _space(), start, steps=4, screen_blocks=2, top=2)
    assert free.trajectory[: len(drop.trajectory)] == drop.trajectory  # the swap phase is the drop-search walk
    assert ev.evaluate(free.trajectory[-1]).fitness <= ev.evaluate(drop.trajectory[-1]).fitness
    assert ev.evaluate(free.best, "val").fitness <= ev.evaluate(drop.best, "val").fitness
