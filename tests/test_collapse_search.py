"""Search space, fitness cache and search determinism/resume on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_collapse_evaluator

from llmcompress.collapse.baselines import laco, shortgpt
from llmcompress.collapse.config import CollapseConfig
from llmcompress.collapse.search import make_space, run_search, select_by_validation
from llmcompress.collapse.space import Candidate, Space


def _evaluator(layers=8, max_bytes=1e9, use_prefix=True, tmp=None):
    return tiny_collapse_evaluator(layers, max_bytes=max_bytes, use_prefix=use_prefix, cache_dir=tmp)


@pytest.fixture(scope="module")
def ev():
    e = _evaluator()
    yield e
    e.close()


def test_encode_decode_roundtrip():
    sp = Space(10, (0.0, 0.5, 1.0), lo=5, hi=9)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = sp.random_genome(rng)
        c = sp.decode(x)
        assert sp.decode(sp.encode(c)) == c
        assert sorted(i for g in c.groups for i in g) == list(range(10))


def test_describe_names_dropped_layers_and_merge_coefficients():
    drop = Candidate.from_keep(10, {3, 4, 7})
    assert drop.describe() == "drop[3, 4] drop[7]"
    sp = Space(10, (0.0, 0.25, 0.5, 0.75, 1.0), lo=7, hi=7)
    x = sp.encode(drop)
    x[9 + 4 * sp.n_kinds + 1] = 3  # layer 4's MLP back at 0.75 in the group led by layer 2
    assert sp.decode(x).describe() == "merge[2, 3, 4](4 mlp 0.75) drop[7]"
    x[9 + 7 * sp.n_kinds : 9 + 8 * sp.n_kinds] = 4  # layer 7 replaces layer 6 in every kind (LaCo's merge)
    assert sp.decode(x).describe() == "merge[2, 3, 4](4 mlp 0.75) merge[6, 7](7 1)"
    assert Candidate.from_keep(10, set()).describe() == "original"


@pytest.mark.parametrize("lo,hi", [(5, 5), (6, 6), (5, 9)])
def test_repair_respects_budget(lo, hi):
    sp = Space(12, (0.0, 0.5, 1.0), lo=lo, hi=hi, max_group=4)
    rng = np.random.default_rng(1)
    for _ in range(50):
        x = rng.integers(0, 2, sp.n_var)
        x[11:] = rng.integers(0, 3, sp.n_var - 11)
        c = sp.decode(sp.repair_one(x))
        assert lo <= c.n_layers <= hi
        assert c.groups[0] == (0,) and c.groups[-1] == (11,)  # protected first/last layers
        assert max(len(g) for g in c.groups) <= 4
    x = rng.integers(0, 2, sp.n_var)
    assert np.array_equal(sp.repair_one(x), sp.repair_one(x))  # deterministic


def test_drop_search_fixes_alpha_to_zero():
    sp = Space(8, (0.0, 0.5, 1.0), lo=5, hi=5, fixed_alpha=0.0)
    c = sp.decode(sp.random_genome(np.random.default_rng(2)))
    assert all(a == 0.0 for g in c.alphas for t in g for a in t)


def test_prefix_cached_fitness_equals_full_recompute(ev, tmp_path):
    full = _evaluator(use_prefix=False)
    disk = _evaluator(max_bytes=0, tmp=tmp_path)  # states offloaded to disk
    assert disk.refs["calib"].states.on_disk
    cands = [Candidate.from_keep(8, {5, 6}), Candidate.from_keep(8, {2}), shortgpt(ev, 5)]
    cands.append(laco(ev, 6, threshold=0.0)[6])
    for c in cands:
        a, b, d = ev.evaluate(c), full.evaluate(c), disk.evaluate(c)
        assert a.kl == pytest.approx(b.kl, rel=1e-4, abs=1e-6) and a.kl == pytest.approx(d.kl, rel=1e-5, abs=1e-7)
        assert a.kl > 0 and a.params < ev.total_params
    disk.close()


def test_no_cache_evaluation_equals_cached(ev):
    naive = _evaluator()
    naive.use_prefix, naive.use_reference = False, False
    for c in (Candidate.from_keep(8, {5, 6}), shortgpt(ev, 5)):
        assert naive.evaluate(c).kl == pytest.approx(ev.evaluate(c).kl, rel=1e-4, abs=1e-6)


def test_laco_reaches_every_budget_when_no_merge_passes(ev):
    path = laco(ev, 4, threshold=2.0)  # cosine never exceeds 2: every pass falls back to its most similar merge
    assert set(path) == set(range(4, 8)) and all(c.n_layers == n for n, c in path.items())  # every count
    strict = laco(ev, 4, threshold=0.0)
    assert min(strict) == 4


def _run(tmp, stop_after=None, resume=False, ev=None, seed=0):
    ev = ev or _evaluator()
    cfg = CollapseConfig(population=5, generations=2, seed=seed, min_layers=4, sim_blocks=1)
    seeds = [shortgpt(ev, n) for n in (5, 6)]
    hist = run_search(cfg, ev, seeds, tmp, model_id="tiny", resume=resume, stop_after=stop_after)
    return hist, ev


def _front(hist):
    return [(c.key, f.fitness) for c, f, _ in hist[-1].front]


@pytest.fixture(scope="module")
def full_run(ev, tmp_path_factory):
    path = tmp_path_factory.mktemp("full")
    return _run(path, ev=ev)[0], path


def test_same_seed_same_front_and_log(tmp_path, ev, full_run):
    h1, path = full_run
    h2, _ = _run(tmp_path / "b", ev=_evaluator())
    assert _front(h1) == _front(h2)
    log = [__import__("json").loads(s) for s in (path / "search_log.jsonl").read_text().splitlines()]
    assert [r["gen"] for r in log] == [0, 1, 2]
    assert all("hv_calib" in r and "hv_val" in r and "best_fitness_val" in r for r in log)
    picks = select_by_validation(ev, 4, 7)
    assert picks and all(4 <= c.n_layers <= 7 for c, _, _ in picks)


def test_resume_equals_uninterrupted(tmp_path, full_run):
    full, _ = full_run
    part, _ = _run(tmp_path / "cut", stop_after=1, ev=_evaluator())
    assert part[-1].gen == 1
    rest, _ = _run(tmp_path / "cut", resume=True, ev=_evaluator())  # fresh evaluator: nothing memoized
    assert [g.gen for g in rest] == [2]
    assert _front(rest) == _front(full)
    lines = (tmp_path / "cut" / "search_log.jsonl").read_text().splitlines()
    assert len(lines) == 3


def test_make_space_single_objective_budget():
    cfg = CollapseConfig(pareto=False, target_layers=5)
    sp = make_space(cfg, 8)
    assert (sp.lo, sp.hi) == (5, 5)


def _run_single(tmp, stop_after=None, resume=False, ev=None):
    ev = ev or _evaluator()
    cfg = CollapseConfig(pareto=False, target_layers=5, population=5, generations=2, seed=3, sim_blocks=1)
    return run_search(cfg, ev, [shortgpt(ev, 5)], tmp, model_id="tiny", resume=resume, stop_after=stop_after)


def test_single_objective_search_checkpoints_and_resumes(tmp_path, ev):
    """--target-layers uses pymoo's GA: its state must be saved each generation, and a resumed run must
    end where an uninterrupted one does (the GA's default tournament could not be pickled)."""
    full = _run_single(tmp_path / "full", ev=ev)
    assert [g.gen for g in full] == [0, 1, 2] and (tmp_path / "full" / "search_state.json").is_file()
    assert all(c.n_layers == 5 for g in full for c, _, _ in g.front)
    best = [min(f.fitness for _, f, _ in g.front) for g in full]
    assert best == sorted(best, reverse=True)  # elitist: the best fitness never gets worse
    _run_single(tmp_path / "cut", stop_after=0, ev=_evaluator())
    rest = _run_single(tmp_path / "cut", resume=True, ev=_evaluator())
    assert [g.gen for g in rest] == [1, 2]
    assert _front(rest) == _front(full)


def test_seeds_enter_the_search_unchanged(tmp_path):
    """A baseline seed with a group longer than max_group (ShortGPT dropping a run of layers) must reach
    the population as it is, not be repaired into another candidate."""
    cfg = CollapseConfig(pareto=False, target_layers=4, population=4, generations=1, max_group=2, sim_blocks=1)
    seed = Candidate.from_keep(8, {2, 3, 4, 5})  # groups (0) (1..5) (6) (7): a group of 5
    plain = make_space(cfg, 8)
    assert plain.decode(plain.repair_one(plain.encode(seed))) != seed  # what used to happen
    sp = make_space(cfg, 8, [seed])
    assert sp.decode(sp.repair_one(sp.encode(seed))) == seed
    ev = _evaluator()
    hist = run_search(cfg, ev, [seed], tmp_path, model_id="tiny")
    assert min(f.fitness for _, f, _ in hist[0].front) <= ev.evaluate(seed).fitness


def test_resumed_log_counts_evaluations_like_an_uninterrupted_run(tmp_path):
    """The `evaluations` column of search_log.jsonl after --resume is monotone and equals the uninterrupted
    run's (it restarted from the fresh evaluator's count: 4, 8, 6, 10; issue 25, finding 12)."""
    import json

    def counts(path):
        return [json.loads(s)["evaluations"] for s in (path / "search_log.jsonl").read_text().splitlines()]

    _run(tmp_path / "full", ev=_evaluator())
    _run(tmp_path / "cut", stop_after=0, ev=_evaluator())
    _run(tmp_path / "cut", resume=True, ev=_evaluator())
    full = counts(tmp_path / "full")
    assert full == sorted(full) and full[0] > 0 and len(full) == 3
    assert counts(tmp_path / "cut") == full
