"""distill: pure pieces (segments, curriculum, losses) and the feature cache / prefetcher."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from llmcompress.distill import cache as cache_mod
from llmcompress.distill import curriculum as cur
from llmcompress.distill import losses
from llmcompress.distill.cache import FeatureCache, cache_key, prefetch
from llmcompress.distill.segments import (
    bi_keep,
    layer_map_from_keep,
    segment_layout,
    teacher_boundaries,
    uniform_keep,
)
from llmcompress.errors import UserError

# ----------------------------------------------------------------------------------------- segments


def test_removal_layout_one_segment_per_student_layer():
    segs = segment_layout(layer_map_from_keep([1, 2, 4]), 6)
    assert [(s.teacher_start, s.teacher_end, s.student_start, s.student_end) for s in segs] == [
        (0, 2, 0, 1), (2, 4, 1, 2), (4, 6, 2, 3)
    ]
    assert teacher_boundaries(segs) == [0, 2, 4, 6]


def test_collapse_layer_map_and_grouping():
    layer_map = [{"sources": [0]}, {"sources": [1, 2]}, {"sources": [3]}, {"sources": [4, 5, 6]}, {"sources": [7]}]
    segs = segment_layout(layer_map, 8, 2)
    assert [(s.teacher_start, s.teacher_end, s.student_start, s.student_end) for s in segs] == [(0, 4, 0, 3), (4, 8, 3, 5)]
    # every teacher and student layer belongs to exactly one segment
    assert sum(s.teacher_end - s.teacher_start for s in segs) == 8
    assert sum(len(s.student_layers) for s in segs) == 5


@pytest.mark.parametrize(
    "layer_map, n_teacher, n_seg, match",
    [
        (layer_map_from_keep(range(4)), 4, None, "fewer layers than its teacher"),
        (layer_map_from_keep(range(5)), 4, None, "fewer layers than its teacher"),
        (layer_map_from_keep([0, 2]), 4, 3, "more than the student"),
        ([{"sources": [2]}, {"sources": [1]}], 4, None, "not in teacher order"),
        ([{"sources": [0]}, {"sources": [9]}], 4, None, "teacher has 4 layers"),
    ],
)
def test_bad_layouts_are_user_errors(layer_map, n_teacher, n_seg, match):
    with pytest.raises(UserError, match=match):
        segment_layout(layer_map, n_teacher, n_seg)


def test_keep_selection():
    assert uniform_keep(30, 15)[0] == 0 and uniform_keep(30, 15)[-1] == 29 and len(uniform_keep(30, 15)) == 15
    assert bi_keep([0.9, 0.1, 0.5, 0.05, 0.7], 3) == [0, 2, 4]


# --------------------------------------------------------------------------------------- curriculum


def test_difficulty_order_is_easy_to_hard():
    assert cur.difficulty_order({0: 0.5, 1: 0.1, 2: 0.9, 3: 0.1}) == [1, 3, 0, 2]


def test_mix_schedule_moves_from_teacher_to_student():
    w = [cur.mix_weight(s, 10, 0.0, 1.0) for s in range(10)]
    assert w[0] == 0.0 and w[-1] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(w, w[1:]))
    t, s = torch.zeros(2, 3), torch.ones(2, 3)
    assert torch.equal(cur.mix_inputs(t, s, 0.0), t) and torch.equal(cur.mix_inputs(t, s, 1.0), s)
    torch.testing.assert_close(cur.mix_inputs(t, s, 0.25), torch.full((2, 3), 0.25))


def test_budget_split_and_rank_assignment():
    assert cur.split_steps(10_000, 1000, 0.5) == (5, 5)
    assert sum(cur.split_steps(1, 1000, 0.5)) == 1
    ranks = cur.assign_ranks([3, 0, 2, 1], 2)
    assert sorted(ranks[0] + ranks[1]) == [0, 1, 2, 3] and len(ranks[0]) == 2
    assert ranks[0] == [k for k in [3, 0, 2, 1] if k in ranks[0]]  # kept in difficulty order


# ------------------------------------------------------------------------------------------- losses


def test_losses_are_zero_at_match_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 8, generator=g)
    b = torch.randn(2, 5, 8, generator=g)
    assert losses.normalized_mse(a, a).item() == 0.0
    assert losses.normalized_mse(a, b).item() > 0.5
    assert losses.normalized_mse(a * 100, b * 100).item() == pytest.approx(losses.normalized_mse(a, b).item(), rel=1e-5)
    assert losses.cosine_loss(a, 3 * a).item() == pytest.approx(0.0, abs=1e-6)
    assert abs(losses.kl_logits(a, a).item()) < 1e-6
    assert losses.kl_logits(a, b).item() > 0


def test_logit_objective_adds_next_token_cross_entropy():
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(2, 5, 11, generator=g)
    t_logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    pure, parts = losses.logit_objective(s_logits, t_logits, ids)
    assert pure.item() == pytest.approx(losses.kl_logits(s_logits, t_logits).item()) and "ce" not in parts
    # position t predicts ids[:, t + 1]; the last position has no target
    logp = torch.log_softmax(s_logits, -1)
    manual = -sum(logp[b, t, ids[b, t + 1]] for b in range(2) for t in range(4)) / 8
    mixed, parts = losses.logit_objective(s_logits, t_logits, ids, ce_weight=0.5)
    assert parts["ce"] == pytest.approx(manual.item(), rel=1e-5)
    assert mixed.item() == pytest.approx(parts["kl"] + 0.5 * manual.item(), rel=1e-5)
    # at the teacher's logits the KL is zero but the hard labels still pull
    same, parts = losses.logit_objective(t_logits, t_logits, ids, ce_weight=1.0)
    assert abs(parts["kl"]) < 1e-6 and same.item() == pytest.approx(parts["ce"]) and parts["ce"] > 0


# -------------------------------------------------------------------------------------------- cache


def _shards(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"ids": torch.randint(0, 9, (2, 4), generator=g), "b0": torch.randn(2, 4, 3, generator=g).bfloat16()} for _ in range(n)]


def test_cache_hit_returns_identical_tensors(tmp_path):
    shards = _shards(3)
    key = cache_key("t", torch.arange(5), [0, 2])
    c = FeatureCache(tmp_path / key)
    assert not c.is_complete(key)
    c.write(iter(shards), key=key)
    again = FeatureCache(tmp_path / key)
    assert again.is_complete(key) and again.n_shards == 3
    assert not again.is_complete("other-key")
    for i, s in enumerate(shards):
        got = again.read(i)
        assert got.keys() == s.keys() and all(torch.equal(got[k], s[k]) for k in s)
    assert torch.equal(again.read(1, ["b0"])["b0"], shards[1]["b0"])
    assert cache_key("t", torch.arange(5), [0, 2]) == key != cache_key("t", torch.arange(6), [0, 2])


def test_full_disk_leaves_no_valid_cache_and_no_half_shard(tmp_path, monkeypatch):
    real = cache_mod._save_file
    calls = {"n": 0}

    def flaky(tensors, path):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(path, "wb") as f:
                f.write(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(cache_mod, "_save_file", flaky)
    c = FeatureCache(tmp_path / "c")
    with pytest.raises(UserError, match="disk filled"):
        c.write(iter(_shards(4)), key="k")
    assert not c.is_complete("k") and not c.index_path.exists()
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["shard-00000.safetensors", "shard-00001.safetensors"]  # finished shards only, no temp file
    monkeypatch.setattr(cache_mod, "_save_file", real)
    c.write(iter(_shards(4)), key="k")  # a rerun rebuilds and validates it
    assert c.is_complete("k")


def test_prefetcher_yields_in_order_and_stays_bounded():
    lock = threading.Lock()
    state = {"loaded": 0, "consumed": 0, "max_ahead": 0}

    def load(i):
        time.sleep(0.002 * (i % 3))  # out-of-order completion in the pool
        with lock:
            state["loaded"] += 1
            state["max_ahead"] = max(state["max_ahead"], state["loaded"] - state["consumed"])
        return i

    got = []
    for x in prefetch(load, range(20), depth=3, workers=3):
        time.sleep(0.003)  # slow consumer: the pool must not run away
        with lock:
            state["consumed"] += 1
        got.append(x)
    assert got == list(range(20))
    assert state["max_ahead"] <= 3 + 1


def test_prefetcher_stops_early_without_hanging():
    gen = prefetch(lambda i: i, range(1000), depth=2)
    assert next(gen) == 0
    gen.close()


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_teacher_features_equal_boundary_states(fam):
    from conftest import TINY_VOCAB, tiny_model

    from llmcompress.distill.cache import teacher_features
    from llmcompress.io.forward import boundary_states

    model = tiny_model(fam, layers=4)
    ids = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    states, _ = boundary_states(model, ids)
    got = teacher_features(model, ids, [0, 1, 3, 4])
    for g, b in zip(got, [0, 1, 3, 4]):
        assert torch.equal(g, states[b])
