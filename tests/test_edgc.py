"""Gradient compression for DDP (comm/edgc.py): 2 and 3 gloo processes on loopback, and the pure math."""

from __future__ import annotations

import math

import pytest
import torch


def test_entropy_estimator():
    from llmcompress.comm.edgc import entropy_bits

    g = torch.Generator().manual_seed(0)
    uniform = torch.rand(200_000, generator=g)
    assert entropy_bits(uniform, fraction=1.0) == pytest.approx(math.log2(1000), abs=0.02)  # flat histogram
    assert entropy_bits(torch.full((1000,), 3.0)) == 0.0  # one bin
    peaked = torch.randn(200_000, generator=g) ** 5  # heavy tails: mass in few bins
    assert entropy_bits(peaked, fraction=1.0) < entropy_bits(torch.randn(200_000, generator=g), fraction=1.0) - 2
    # the strided subsample sees a fraction of the elements: a tensor whose even elements are constant
    alt = torch.stack([torch.zeros(50_000), torch.rand(50_000, generator=g)], 1).reshape(-1)
    assert entropy_bits(alt, fraction=0.5) == 0.0 and entropy_bits(alt, fraction=1.0) > 1.0


def test_quantification_model_and_bounded_step():
    from llmcompress.comm.edgc import next_rank, target_rank

    assert target_rank(8.0, 8.0, 0.05, 2, 32) == 32  # at the reference: r_max
    assert target_rank(8.5, 8.0, 0.05, 2, 32) == 32  # more information: still r_max
    assert target_rank(8.0 - 0.4, 8.0, 0.05, 2, 32) == 2  # dropped by the span: r_min
    assert target_rank(8.0 - 0.2, 8.0, 0.05, 2, 32) == 17  # halfway: linear
    assert [next_rank(32, 2, 4), next_rank(10, 12, 4), next_rank(3, 20, 4)] == [28, 12, 7]


def test_reference_is_the_peak_window_and_warmup_is_not_a_window():
    """A synthetic entropy trace whose peak is the second window: later ranks follow the drop from that peak."""
    from llmcompress.comm.edgc import EDGCState

    ps = EDGCState(r_min=2, r_max=32, start_iter=2, window=2, entropy_span=0.1, max_step=100)
    assert (ps.start_powerSGD_iter, ps.rank) == (2, 32)
    # per step: 2 warm-up steps (dense, entropy 9.9: must not become the reference), then windows of 2 steps
    # with means 7.0, 8.0 (the peak), 7.6, 7.2, 8.4 (a new peak), 8.0
    trace = [9.9, 9.9, 7.0, 7.0, 7.8, 8.2, 7.6, 7.6, 7.2, 7.2, 8.4, 8.4, 8.0, 8.0]
    ranks, refs = [], []
    for step, h in enumerate(trace):
        ps.iter = step + 1  # torch counts the step in its hook, before end_step closes it
        ps.step_h = [h * 10.0, 10.0]
        ps.close_step()
        if step >= 3 and (step - 1) % 2 == 0:  # a window closed
            ranks.append(ps.rank)
            refs.append(ps.h_ref)
    assert refs == pytest.approx([7.0, 8.0, 8.0, 8.0, 8.4, 8.4])
    # 7.6 is 0.4 = half the span (0.1 x 8.0) below the peak: rank 17; 7.2 is a whole span below: r_min.
    # (A first-window reference, 7.0, would have kept r_max for 7.6 and 7.2.) 8.0 is 0.4 / 0.84 below 8.4.
    assert ranks == [32, 32, 17, 2, 32, round(2 + 30 * (1 - 0.4 / 0.84))]
    assert ps.rank_trace[:3] == [None, None, 32] and ps.entropy_trace[0] == pytest.approx(9.9)


def _psgd_bytes(shapes, rank, min_rate=2.0):
    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        total += 4 * ((n + m) * r if len(shape) > 1 and (n + m) * r * min_rate < n * m else n * m)
    return total


@pytest.mark.dist
def test_two_ranks_zip_bit_identical_forced_rank_change_keeps_error_feedback(tmp_path):
    from llmcompress.comm._edgc_selftest import _model, run

    res = run(2, str(tmp_path), "schemes,force")
    shapes = [tuple(p.shape) for p in _model().parameters()]
    dense = 4 * sum(math.prod(s) for s in shapes)  # 2 ranks: a ring all-reduce sends the payload once
    for r in res:
        assert torch.equal(r["zip"]["flat"], r["none"]["flat"])  # lossless: same bits as plain all-reduce
        assert [x["comm_bytes"] for x in r["none"]["recs"]] == [dense] * 6
        assert all(0 < x["comm_bytes"] < dense for x in r["zip"]["recs"])  # counted on the wire, compressed
        # PowerSGD: dense warm-up steps are counted too, then P and Q (and the uncompressed tensors)
        assert [x["comm_bytes"] for x in r["powersgd"]["recs"]] == [dense] * 2 + [_psgd_bytes(shapes, 8)] * 6
        assert [x["comm_bytes"] for x in r["edgc"]["recs"]] == [dense] * 2 + [_psgd_bytes(shapes, 32)]
        # the same 2-step warm-up for both compressed schemes: DDP's reduced gradients are plain all-reduce's bits,
        # then compression starts at step 2 (torch's start_powerSGD_iter semantics)
        for scheme in ("powersgd", "edgc"):
            g, g0 = r[scheme]["grads"], r["none"]["grads"]
            assert torch.equal(g[0], g0[0]) and torch.equal(g[1], g0[1])
            assert r[scheme]["rank_trace"][:3] == [None, None, 8 if scheme == "powersgd" else 32]
        assert not torch.equal(r["powersgd"]["grads"][2], r["none"]["grads"][2])
        f = r["force"]
        assert f["changes"][5] == {"error_kept": True, "pq_cleared": True, "rank": 2}
        assert f["changes"][8] == {"error_kept": True, "pq_cleared": True, "rank": 6}
        assert f["rank_trace"][:9] == [None] * 3 + [8] * 3 + [2] * 3 and f["rank_trace"][9] == 6
        assert [x["comm_bytes"] for x in f["recs"]][6:9] == [_psgd_bytes(shapes, 2)] * 3
        c = r["carry"]  # carry_q: the warm-start Q survives the change too, resized
        assert c["changes"][5] == {"error_kept": True, "pq_cleared": False, "rank": 2, "q_carried": True}
        assert c["changes"][8] == {"error_kept": True, "pq_cleared": False, "rank": 6, "q_carried": True}
        assert c["rank_trace"] == f["rank_trace"] and [x["comm_bytes"] for x in c["recs"]] == [x["comm_bytes"] for x in f["recs"]]
        assert not torch.equal(c["flat"], f["flat"])
    for case in ("force", "carry"):
        assert torch.equal(res[0][case]["flat"], res[1][case]["flat"])  # replicas stay in sync


@pytest.mark.dist
def test_three_ranks_agree_on_rank_and_resume_continues_the_schedule(tmp_path):
    from llmcompress.comm._edgc_selftest import run

    res = run(3, str(tmp_path), "resume")
    full = [r["full"] for r in res]
    # local gradients differ (each rank's inputs are scaled differently), the rank schedule does not
    assert all(f["rank_trace"] == full[0]["rank_trace"] for f in full)
    assert len(full[0]["summary"]["rank_changes"]) >= 1 and full[0]["summary"]["final_rank"] < 8  # it adapted
    for r in res:
        a, b = r["full"], r["resumed"]
        assert r["half"]["rank_trace"] == a["rank_trace"][:11]
        assert b["rank_trace"] == a["rank_trace"]
        assert [h is None for h in b["entropy_trace"]] == [h is None for h in a["entropy_trace"]]
        assert [h for h in b["entropy_trace"] if h] == pytest.approx([h for h in a["entropy_trace"] if h], abs=1e-3)
        assert b["summary"]["comm_bytes"] == a["summary"]["comm_bytes"]
        # 3 ranks: gloo's ring sums chunks in an order that depends on the bucket layout (rebuilt on resume)
        torch.testing.assert_close(b["flat"], a["flat"], rtol=0, atol=1e-6)
