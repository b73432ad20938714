"""The collapse fitness speed-ups are exact: candidates' prefix states, racing in the search, torchrun population
evaluation (2 gloo processes give the 1-process front bit for bit); bf16 stays within tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_collapse_evaluator

from llmcompress.collapse.baselines import shortgpt
from llmcompress.collapse.config import CollapseConfig
from llmcompress.collapse.search import run_search, select_by_validation, survival_rule
from llmcompress.collapse.space import Candidate, Space

pytestmark = pytest.mark.usefixtures("one_thread")


def _family(n=12, seed=0):
    """Random 8-layer candidates, each followed by children that keep its first groups and change later ones."""
    sp = Space(8, (0.0, 0.5, 1.0), lo=4, hi=7, max_group=3)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = sp.repair_one(sp.random_genome(rng))
        out.append(sp.decode(x))
        for gene in (5, 6, 7 + 6 * sp.n_kinds + 1, 7 + 7 * sp.n_kinds):  # late cut bits, late coefficients
            y = x.copy()
            y[gene] = (y[gene] + 1) % (2 if gene < 7 else 3)
            out.append(sp.decode(sp.repair_one(y)))
    return out


@pytest.mark.parametrize("budget", [1e9, 3 * 6 * 24 * 64 * 4])  # room for all states / for three (evictions)
def test_prefix_states_give_the_fitness_of_a_full_evaluation(budget):
    """A candidate started from another candidate's cached boundary state scores exactly (bit for bit) what
    an evaluation from the original's prefix scores, on calibration and validation."""
    cands = _family()
    cached = tiny_collapse_evaluator()
    cached.prefix.max_bytes = budget
    plain = tiny_collapse_evaluator()
    for c in cands:
        for split in ("calib", "val"):
            assert cached.evaluate(c, split).fitness == plain.evaluate(c, split).fitness, (c.describe(), split)
    assert cached.stats.prefix_hits > 5  # the cache was used (else this test checks nothing)
    assert cached.stats.layers_run < plain.stats.layers_run
    assert cached.prefix.nbytes <= budget


def test_prefix_state_keys_separate_coefficients_and_splits():
    """Two candidates with the same groups but other merge coefficients never share a state."""
    ev = tiny_collapse_evaluator()
    ev.prefix.max_bytes = 1e9
    sp = Space(8, (0.0, 0.5, 1.0), lo=6, hi=6, max_group=3)
    a = Candidate.from_keep(8, {2, 5})
    x = sp.encode(a)
    x[7 + 2 * sp.n_kinds : 7 + 3 * sp.n_kinds] = 1  # layer 2 merged at 0.5 instead of dropped
    b = sp.decode(x)
    assert a.groups == b.groups and a.alphas != b.alphas
    fa, fb = ev.evaluate(a).fitness, ev.evaluate(b).fitness
    ref = tiny_collapse_evaluator()
    assert (fa, fb) == (ref.evaluate(a).fitness, ref.evaluate(b).fitness) and fa != fb


def test_bf16_fitness_within_tolerance():
    ev32, ev16 = tiny_collapse_evaluator(), tiny_collapse_evaluator()
    ev16.compute_dtype = "bfloat16"
    cands = _family(4)
    a = np.array([ev32.evaluate(c).kl for c in cands])
    b = np.array([ev16.evaluate(c).kl for c in cands])
    assert not np.array_equal(a, b)  # bf16 did run
    np.testing.assert_allclose(b, a, rtol=0.1, atol=0.02)


def test_survival_rule_counts_dominating_parents():
    F = np.array([[5, 1.0], [5, 2.0], [6, 0.5], [7, 3.0]])
    rule = survival_rule(F, 3, pareto=True)
    six, five = Candidate.from_keep(8, {2, 5}), Candidate.from_keep(8, {2, 5, 6})
    assert rule(six)(2.5)  # 3 parents with <= 6 layers are surely better: never survives
    assert not rule(six)(2.0)  # (5, 2.0) is not surely better than a candidate of fitness >= 2.0
    assert not rule(five)(2.5)  # only 2 parents with <= 5 layers
    single = survival_rule(F[:, 1:], 3, pareto=False)
    assert single(five)(2.01) and not single(five)(2.0)
    assert survival_rule(F[:2], 3, pareto=True) is None  # fewer parents than survivors: no racing


def _search(ev, tmp, pareto, racing, seed=0):
    # a narrow front (6..7 layers) so that several parents share a layer count and offspring can be pruned
    cfg = CollapseConfig(population=5, generations=3, seed=seed, min_layers=6, sim_blocks=1, racing=racing, pareto=pareto,
                         target_layers=None if pareto else 5)
    seeds = [shortgpt(ev, n) for n in ((6, 7) if pareto else (5,))]
    for c in seeds:
        ev.evaluate(c)
    hist = run_search(cfg, ev, seeds, tmp, model_id="tiny")
    lo = 6 if pareto else 5
    picks = select_by_validation(ev, lo, 7 if pareto else 5)
    return [[(c.key, f.fitness) for c, f, _ in g.front] for g in hist], [(c.key, f.fitness, v.fitness) for c, f, v in picks]


@pytest.mark.parametrize("pareto", [True, False])
def test_racing_changes_no_survivor_and_no_pick(tmp_path, pareto):
    """Racing stops offspring that cannot survive; every generation's front and the picks after selection
    equal those of the exhaustive search (several seeds; the test fails if nothing was ever pruned)."""
    pruned = 0
    for seed in range(3):
        full = tiny_collapse_evaluator(data_seed=seed)
        full.batch = 1  # a bound after every block
        race = tiny_collapse_evaluator(data_seed=seed)
        race.batch = 1
        a = _search(full, tmp_path / f"a{seed}", pareto, racing=False, seed=seed)
        b = _search(race, tmp_path / f"b{seed}", pareto, racing=True, seed=seed)
        assert a == b
        assert full.stats.pruned == 0
        print("pruned", pareto, seed, race.stats.pruned, race.stats.evaluations)
        pruned += race.stats.pruned
        for key, fit in race.memo.items():  # a finished evaluation after pruning equals an uninterrupted one
            if key in full.memo:
                assert fit.fitness == full.memo[key].fitness
    assert pruned > 0


def test_pruned_candidate_finishes_with_the_uninterrupted_value():
    ev, ref = tiny_collapse_evaluator(), tiny_collapse_evaluator()
    ev.batch = ref.batch = 1
    c = Candidate.from_keep(8, {2, 3, 5})
    part = ev.evaluate(c, prune=lambda lb: True)
    assert part.partial and ev.known(c) is None and c.key in ev.calib_keys()
    full = ev.evaluate(c)
    assert not full.partial and full.fitness == ref.evaluate(c).fitness
    assert part.fitness <= full.fitness and ev.lower_bound(c) == full.fitness


WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import torch.distributed as dist
dist.init_process_group("gloo")
from conftest import tiny_collapse_evaluator
from llmcompress.collapse.baselines import shortgpt
from llmcompress.collapse.config import CollapseConfig
from llmcompress.collapse.refine import refine
from llmcompress.collapse.search import make_space, run_search, select_by_validation

ev = tiny_collapse_evaluator(data_seed=1)
ev.batch = 1
ev.prefix.max_bytes = 1e9
cfg = CollapseConfig(population=6, generations=3, seed=2, min_layers=4, sim_blocks=1)
seeds = [shortgpt(ev, n) for n in (5, 6)]
for c in seeds:
    ev.evaluate(c)
hist = run_search(cfg, ev, seeds, {out!r}, model_id="tiny")
picks = select_by_validation(ev, 4, 7)
walk = refine(ev, make_space(cfg, 8, seeds), picks[0][0], steps=2, screen_blocks=2, top=2)
res = dict(fronts=[[[repr(c.key), f.fitness, v.fitness] for c, f, v in g.front] for g in hist],
           picks=[[repr(c.key), f.fitness, v.fitness] for c, f, v in picks],
           walk=[repr(c.key) for c in walk.trajectory], best=repr(walk.best.key),
           evaluations=[g.record["evaluations"] for g in hist], rank=dist.get_rank(), mine=ev.stats.evaluations)
with open({out!r} + f"/result{{dist.get_rank()}}.json", "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_two_gloo_processes_give_the_single_process_front(tmp_path):
    """Under torchrun each rank scores a slice of every population (and of a walk's neighbours); the fronts,
    the picks and the walk equal the single-process run bit for bit, and the work was really split."""
    tests = str(Path(__file__).resolve().parent)
    script = tmp_path / "worker.py"
    for name, world in (("one", 1), ("two", 2)):
        (tmp_path / name).mkdir()
        script.write_text(WORKER.format(tests=tests, out=str(tmp_path / name)))
        env = dict(os.environ, OMP_NUM_THREADS="1", LLMCOMPRESS_PROGRESS="0")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(script)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "result0.json").read_text())
    two = [json.loads((tmp_path / "two" / f"result{k}.json").read_text()) for k in (0, 1)]
    for res in two:
        for k in ("fronts", "picks", "walk", "best", "evaluations"):
            assert res[k] == one[k], k
    assert max(r["mine"] for r in two) < one["mine"]  # each rank scored only part of the candidates
    assert (tmp_path / "two" / "search_state.json").is_file()


def test_budget_plan_grows_with_the_budget_and_the_speed():
    from llmcompress.collapse.budget import LADDER, choose, predict_seconds

    kw = dict(n_layers=30, seq_len=256, pareto=True, gelaco=True)
    times = [predict_seconds(r, 0.1, **kw) for r in LADDER]
    assert times == sorted(times) and len(set(times)) == len(times)  # every rung costs more than the one before
    picks = [LADDER.index(choose(m, 0.1, **kw).settings) for m in (0.1, 5, 20, 60, 600, 10**5)]
    assert picks == sorted(picks) and picks[0] == 0 and picks[-1] == len(LADDER) - 1
    fast, slow = choose(20, 0.05, **kw), choose(20, 0.5, **kw)
    assert LADDER.index(fast.settings) >= LADDER.index(slow.settings)
    plan = choose(20, 0.1, **kw)
    assert plan.predicted_s <= 20 * 60 or LADDER.index(plan.settings) == 0
    assert str(plan.settings["calib_tokens"]) in plan.describe()


def test_budget_minutes_sizes_the_run_and_the_report_says_so(tmp_path, tiny_hf_dir):
    """`--budget-minutes` measures, picks a rung of the ladder, runs with it, and the report states it along
    with the settings that produced the rows."""
    from llmcompress.collapse.budget import LADDER

    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 60 + "\n\n") * 20)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"calib_source: {text}\nseq_len: 32\neval_tokens: 0\npiqa_limit: 0\nlaco_threshold: 0.0\nmin_layers: 3\n"
                    "save: all\nsave_dtype: float32\n")
    hf = tiny_hf_dir
    env = dict(os.environ, LLMCOMPRESS_PROGRESS="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "llmcompress", "collapse", str(hf), "--spec", str(spec), "--pareto", "--budget-minutes", "0.01",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--budget-minutes 0.01: measured" in r.stderr
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert {k: cfg[k] for k in LADDER[0]} == LADDER[0]  # 0.6 s fits no rung: the smallest
    report = (tmp_path / "o" / "report.md").read_text()
    assert "- budget: --budget-minutes 0.01" in report and f"population {LADDER[0]['population']}" in report
    assert "- settings: gelaco rows: 64 calibration and 64 validation blocks of 32 tokens" in report


def _exhaustive_picks(ev, lo, hi, top=2):
    """select_by_validation's definition, every candidate scored in full (no racing anywhere)."""
    by: dict = {}
    for c in ev.archive.values():
        if lo <= c.n_layers <= hi:
            by.setdefault(c.n_layers, []).append((c, ev.evaluate(c)))
    out = []
    for n in sorted(by):
        ranked = sorted(by[n], key=lambda t: t[1].fitness)[:top]
        out.append(min(((c, f, ev.evaluate(c, "val")) for c, f in ranked), key=lambda t: t[2].fitness))
    return [(c.key, f.fitness, v.fitness) for c, f, v in out]


def test_validation_racing_picks_what_full_validation_picks(tmp_path):
    for seed in range(3):
        ev = tiny_collapse_evaluator(data_seed=seed)
        ev.batch = 1
        _, picks = _search(ev, tmp_path / f"s{seed}", True, racing=True, seed=seed)
        full = tiny_collapse_evaluator(data_seed=seed)
        full.batch = 1
        for c in ev.archive.values():
            full.evaluate(c)
        full.archive = dict(ev.archive)
        assert picks == _exhaustive_picks(full, 6, 7)


def test_screen_racing_keeps_the_best_neighbours():
    """The walk's screening with racing returns the same `top` neighbours, in the same order, as screening
    every neighbour in full, and prunes some."""
    from llmcompress.collapse.refine import SCREEN, add_screen, screen, swap_neighbours

    pruned = 0
    for seed in range(2):
        ev, ref = tiny_collapse_evaluator(data_seed=seed), tiny_collapse_evaluator(data_seed=seed)
        for e in (ev, ref):
            add_screen(e, 4)
        sp = Space(8, (0.0, 0.5, 1.0), lo=5, hi=5, max_group=4)
        inc = Candidate.from_keep(8, {2, 5, 6})
        neigh = [sp.decode(y) for y in swap_neighbours(sp, sp.encode(inc))]
        for top in (1, 3):
            ev.memo.clear()
            ev.partial.clear()
            fits = screen(ev, neigh, top)
            pruned += sum(f.partial for f in fits)
            fast = sorted((f.fitness, k) for k, f in enumerate(fits))[:top]
            slow = sorted((ref.evaluate(n, SCREEN).fitness, k) for k, n in enumerate(neigh))[:top]
            assert fast == slow
    assert pruned > 0


def test_default_spec_file_is_the_default_config():
    """searches/collapse-default.yaml documents the defaults: loading it gives CollapseConfig() exactly."""
    from llmcompress.collapse.config import load_spec

    path = Path(__file__).resolve().parents[1] / "searches" / "collapse-default.yaml"
    assert load_spec(path).to_dict() == CollapseConfig().to_dict()


@pytest.mark.dist
def test_cli_under_torchrun_writes_the_single_process_front(tmp_path, tiny_hf_dir):
    """`torchrun --nproc-per-node 2 -m llmcompress collapse ...`: rank 0 writes the same pareto.json front (and
    the same search log) as one process; the other rank writes nothing."""
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"calib_source: {text}\nseq_len: 32\ncalib_tokens: 128\nval_tokens: 64\npopulation: 4\ngenerations: 2\n"
                    "eval_tokens: 0\npiqa_limit: 0\nlaco_threshold: 0.0\nmin_layers: 3\nsave: all\ntune_steps: 4\nrefine_steps: 1\n"
                    "batch_blocks: 1\n")
    env = dict(os.environ, LLMCOMPRESS_PROGRESS="0", OMP_NUM_THREADS="1")
    args = ["-m", "llmcompress", "collapse", str(tiny_hf_dir), "--spec", str(spec), "--pareto"]
    one = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "one")], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args, "--out",
                          str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "pareto.json").read_text()) for d in ("one", "two"))
    keys = ("name", "layers", "fitness_calib", "fitness_val", "changes")
    assert [{k: r[k] for k in keys} for r in a["front"]] == [{k: r[k] for k in keys} for r in b["front"]]
    assert a["evaluations"] > b["evaluations"] > 0  # rank 0 scored only its share itself
    log = [(json.loads(x)["gen"], json.loads(x)["front"]) for x in (tmp_path / "one" / "search_log.jsonl").read_text().splitlines()]
    assert log == [(json.loads(x)["gen"], json.loads(x)["front"]) for x in (tmp_path / "two" / "search_log.jsonl").read_text().splitlines()]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
