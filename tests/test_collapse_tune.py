"""Merge-coefficient tuning by gradient descent (collapse/tune.py) on a tiny model."""

from __future__ import annotations

import torch
from conftest import tiny_collapse_evaluator

from llmcompress.collapse.operator import merge_tensors
from llmcompress.collapse.space import Candidate
from llmcompress.collapse.tune import STATE_FILE, _Group, blend, tune
from llmcompress.io.forward import run_layers


def _evaluator(layers=8):
    return tiny_collapse_evaluator(layers, data_seed=1)


def _start():
    # layers 2-4 collapsed into 2 at mid-grid coefficients, layer 6 merged into 5 at 0.5
    groups = ((0,), (1,), (2, 3, 4), (5, 6), (7,))
    alphas = ((), (), ((0.5, 0.25, 0.75), (0.5, 0.5, 0.5)), ((0.5, 0.5, 0.5),), ())
    return Candidate(groups, alphas)


def test_blend_equals_the_merge_operator():
    g = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(5, 7, generator=g) for _ in range(3))
    got = blend(base, [a - base, b - base], torch.tensor([0.3, 0.8]))
    assert torch.allclose(got, merge_tensors(base, [a, b], [0.3, 0.8]), atol=1e-6)


def test_differentiable_layer_scores_like_the_evaluator():
    """At the start coefficients, the tuning forward gives the evaluator's KL: the two paths build the same layers."""
    ev = _evaluator()
    c = _start()
    ref = ev.refs["calib"]
    groups = {g: _Group([ev.layers[i] for i in grp], c.alphas[g], ev.adapter.kind_of) for g, grp in enumerate(c.groups) if len(grp) > 1}
    for grp in groups.values():
        grp.materialize()
    g0 = c.first_changed()
    layers = [groups[g].module if g in groups else ev.layers[grp[0]] for g, grp in enumerate(c.groups)][g0:]
    with torch.no_grad():
        h = run_layers(ev.model, ref.states.get(c.groups[g0][0], slice(0, ref.n_blocks)), layers, [grp[0] for grp in c.groups][g0:], output="hidden")
        kl = float(ev.scored_kl(h[:, :: ref.stride], ref.top_idx, ref.top_logp).mean())
    assert abs(kl - ev.kl(c, ref)) < 1e-5


def test_tuning_lowers_calibration_kl_within_bounds_and_leaves_the_model_alone():
    ev = _evaluator()
    before = {n: p.detach().clone() for n, p in ev.model.named_parameters()}
    flags = {n: p.requires_grad for n, p in ev.model.named_parameters()}
    c = _start()
    res = tune(ev, c, steps=30, lr=0.1)
    assert res.tuned.groups == c.groups and res.tuned.alphas != c.alphas
    assert all(0.0 <= a <= 1.0 for g in res.tuned.alphas for t in g for a in t)
    assert ev.evaluate(res.tuned).kl < ev.evaluate(c).kl
    assert res.best == (res.tuned if res.fitness_val_tuned < res.fitness_val_start else c)
    for n, p in ev.model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None and p.requires_grad == flags[n], n


def test_shared_coefficients_stay_shared():
    ev = _evaluator()
    res = tune(ev, _start(), steps=10, lr=0.1, per_kind=False)
    assert all(len(set(t)) == 1 for g in res.tuned.alphas for t in g)
    assert res.tuned.alphas != _start().alphas


def test_deterministic_and_resumed_from_state(tmp_path):
    state = tmp_path / STATE_FILE
    a = tune(_evaluator(), _start(), steps=12, lr=0.1, state_path=state)
    b = tune(_evaluator(), _start(), steps=12, lr=0.1)
    assert a.tuned == b.tuned
    calls = []
    c = tune(_evaluator(), _start(), steps=12, lr=0.1, state_path=state, on_step=calls.append)
    assert c.tuned == a.tuned and calls == []  # the finished tuning is reused, not rerun
    other = Candidate.from_keep(8, {3, 6})
    d = tune(_evaluator(), other, steps=3, lr=0.1, state_path=state)  # another start at another count tunes afresh
    assert d.tuned.groups == other.groups


def test_original_and_zero_steps_return_the_start():
    ev = _evaluator()
    orig = Candidate.from_keep(8, set())
    assert tune(ev, orig, steps=5).best == orig
    assert tune(ev, _start(), steps=0).best == _start()
