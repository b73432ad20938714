"""Activation compression (llmcompress/actcomp): unbiased sketched weight gradients, exact input gradients,
factored gradients, the saved-bytes count against the autograd graph, one sketch per shared input, training
and bit-identical resume on a tiny LLaMA built from config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

from llmcompress.actcomp import compress_activations
from llmcompress.actcomp.sketch import allocate_ranks, projection, projection_seed

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(n=96, d_in=64, d_out=24, seed=0):
    """A linear layer and an input with a decaying spectrum (so a top-r truncation is visibly biased)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d_in, d_out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g) / 8)
        lin.bias.copy_(torch.randn(d_out, generator=g))
    basis = torch.linalg.qr(torch.randn(d_in, d_in, generator=g))[0]
    x = torch.randn(n, d_in, generator=g) * (0.93 ** torch.arange(d_in, dtype=torch.float32)) @ basis.T
    delta = torch.randn(n, d_out, generator=g)
    return lin, x, delta


def _grads(lin, x, delta, plain=False, **kw):
    """(dW, dX, db) of sum(y * delta) through `lin`, compressed with `kw` (plain: the stock nn.Linear)."""
    lin.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if plain:
        (lin(x) * delta).sum().backward()
        return lin.weight.grad.clone(), x.grad.clone(), lin.bias.grad.clone()
    step = kw.pop("step", 0)
    with compress_activations(lin, **kw) as ac:
        ac.set_step(step)
        (lin(x) * delta).sum().backward()
    return lin.weight.grad.clone(), x.grad.clone(), lin.bias.grad.clone()


def _slope(ks, errs):
    lx, ly = [math.log(k) for k in ks], [math.log(e) for e in errs]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_mean_of_k_estimates_converges_like_k_to_minus_half_while_top_r_svd_plateaus(kind):
    lin, x, delta = _problem()
    exact, _, _ = _grads(lin, x, delta, plain=True)
    r, ks, reps = 16, [1, 4, 16, 64, 256], 4
    est = torch.stack([_grads(lin, x, delta, rank=r, kind=kind, step=s)[0] for s in range(reps * ks[-1])])
    est = est.view(reps, ks[-1], *exact.shape)
    errs = [float(torch.stack([(est[i, :k].mean(0) - exact).norm() for i in range(reps)]).mean() / exact.norm()) for k in ks]
    assert -0.6 <= _slope(ks, errs) <= -0.4, errs
    # control: LoRAct-style truncation X ~ X Q Qᵀ, Q the top-r subspace of a randomized SVD (one power
    # iteration, its own random start per draw): biased, so the mean of K of them stalls at its bias
    def truncated(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.linalg.qr(x.T @ (x @ (x.T @ torch.randn(x.shape[0], r, generator=g))))[0]
        return delta.T @ (x @ q) @ q.T

    ctl = torch.stack([truncated(s) for s in range(reps * ks[-1])]).view(reps, ks[-1], *exact.shape)
    ctl_errs = [float(torch.stack([(ctl[i, :k].mean(0) - exact).norm() for i in range(reps)]).mean() / exact.norm()) for k in ks]
    assert _slope(ks[2:], ctl_errs[2:]) > -0.1, ctl_errs  # plateau
    assert errs[-1] < ctl_errs[-1] < errs[0], (errs, ctl_errs)  # one sketch is noisier; 256 beat the bias


def test_input_and_bias_gradients_are_exact_and_forward_unchanged():
    lin, x, delta = _problem()
    w0, dx0, db0 = _grads(lin, x, delta, plain=True)
    w1, dx1, db1 = _grads(lin, x, delta, rank=4)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db1, db0, rtol=1e-6, atol=1e-6)
    assert (w1 - w0).norm() > 1e-3 * w0.norm()  # the weight gradient is an estimate (not the exact one)
    with compress_activations(lin, rank=4):
        y = lin(x.requires_grad_(True))
    torch.testing.assert_close(y, nn.functional.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    assert "forward" not in lin.__dict__ and "_actcomp" not in lin.__dict__  # restored on exit


def test_estimate_is_the_formula_with_the_regenerated_projection():
    lin, x, delta = _problem()
    w, _, _ = _grads(lin, x, delta, rank=8, seed=5, step=3)
    p = projection(lin.in_features, 8, projection_seed(5, 3, 0))
    torch.testing.assert_close(w, (delta.T @ (x @ p)) @ p.T, rtol=1e-5, atol=1e-5)


def test_factored_gradient_equals_dense_estimate_and_sgd_from_factors_is_exact():
    lin, x, delta = _problem()
    dense, _, _ = _grads(lin, x, delta, rank=8, step=2)
    seen = []
    lin.zero_grad(set_to_none=True)
    with compress_activations(lin, rank=8, co_compress=True, on_factors=lambda n, m, u, v: seen.append((u.shape, v.shape))) as ac:
        ac.set_step(2)
        (lin(x.clone().requires_grad_(True)) * delta).sum().backward()
        assert lin.weight.grad is None and seen == [((24, 8), (8, 64))]  # d_out x r and r x d_in, no dense grad
        u, v = ac.factors[""]
        assert (u @ v - dense).abs().max() <= 1e-5
        w0 = lin.weight.detach().clone()
        ac.sgd_step(0.1)
        assert (lin.weight.detach() - (w0 - 0.1 * dense)).abs().max() <= 1e-5
    with compress_activations(lin, rank=8, co_compress=True) as ac:
        ac.set_step(2)
        (lin(x.clone().requires_grad_(True)) * delta).sum().backward()
        ac.materialize()
    assert (lin.weight.grad - dense).abs().max() <= 1e-5


def _graph_saved_bytes(loss, params) -> int:
    """Walk the autograd graph from `loss` and add up the storages its nodes hold (params excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen, storages, stack = set(), {}, [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        values = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):  # a custom Function's node is its ctx
            values += list(node.saved_tensors)
        for v in values:
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in skip:
                        storages[st.data_ptr()] = st.nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(storages.values())


@pytest.mark.parametrize("rank", [None, 0.25])
@pytest.mark.parametrize("bf16", [False, True])
def test_saved_bytes_counter_matches_what_the_autograd_graph_holds(rank, bf16):
    model = tiny_model("llama", layers=2).train()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with compress_activations(model, rank=rank) as ac:
        ac.set_step(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        counted = ac.counter.total
        assert counted == _graph_saved_bytes(loss, list(model.parameters()))
        loss.backward()


def test_shared_inputs_are_sketched_once():
    model = tiny_model("llama", layers=2).train()
    model.lm_head.requires_grad_(False)
    n, d, inter = 2 * 24, 64, 128
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with compress_activations(model, rank=0.25) as ac:
        ac.set_step(0)
        model(input_ids=ids, labels=ids).loss.backward()
        s = ac.counter.summary()
    g = ac.groups
    assert g["model.layers.0.self_attn.q_proj"] == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert g["model.layers.1.mlp.gate_proj"] == ["model.layers.1.mlp.up_proj"]
    # o_proj's input is a view of the attention output SDPA saves anyway: not sketched (it would add bytes)
    assert "model.layers.0.self_attn.o_proj" not in g
    # per layer: one sketch for q/k/v, gate/up, down (not six), fp32
    assert s["saved_linear_input_bytes"] == 2 * n * 4 * (d // 4 + d // 4 + inter // 4)
    assert s["saved_linear_input_uncompressed_bytes"] == 2 * n * 4 * (d + d + inter)


def _train(model, steps, rank, *, start=0, opt=None, state=None, ids=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    with compress_activations(model, rank=rank, seed=7) as ac:
        if state is not None:
            ac.load_state_dict(state)
        for step in range(start, start + steps):
            ac.set_step(step)
            loss = model(input_ids=ids[step % len(ids)], labels=ids[step % len(ids)]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out, opt, ac.state_dict()


def _text(n_batches=4):
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 32, (8,), generator=g)  # a short repeating pattern: learnable in a few steps
    return [torch.stack([base.roll(int(torch.randint(0, 8, (1,), generator=g))).repeat(4) for _ in range(4)]) for _ in range(n_batches)]


def test_training_with_compression_reaches_the_uncompressed_loss():
    ids = _text()
    ref, _, _ = _train(tiny_model("llama", layers=2).train(), 40, None, ids=ids)
    got, _, _ = _train(tiny_model("llama", layers=2).train(), 40, 0.25, ids=ids)
    assert got[0] == ref[0]  # same model, same batch: the forward is not changed
    end_ref, end_got = sum(ref[-4:]) / 4, sum(got[-4:]) / 4
    assert end_ref < 0.1 * ref[0]
    assert abs(end_got - end_ref) < 0.05 * (ref[0] - end_ref)  # within 5% of the loss drop of the uncompressed run


@pytest.mark.parametrize("rank", [0.25, "auto"])
def test_resume_is_bit_identical(rank):
    ids = _text()
    full = tiny_model("llama", layers=2).train()
    _train(full, 6, rank, ids=ids)
    part = tiny_model("llama", layers=2).train()
    _, opt, state = _train(part, 3, rank, ids=ids)
    sd, osd = {k: v.clone() for k, v in part.state_dict().items()}, opt.state_dict()
    resumed = tiny_model("llama", layers=2, seed=5).train()  # other weights: everything comes from the state
    resumed.load_state_dict(sd)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    opt2.load_state_dict(osd)
    _train(resumed, 3, rank, start=3, opt=opt2, state=state, ids=ids)
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    if rank == "auto":
        assert state["auto_ranks"] is not None


def test_auto_ranks_spend_the_budget_and_follow_the_gradient_energy():
    assert allocate_ranks([64, 64, 128], 0.25) == [16, 16, 32]
    r = allocate_ranks([64, 64, 128], 0.25, [1.0, 16.0, 1.0])
    assert sum(r) == 64 and r[1] > r[0] and r[1] == 4 * r[0] or abs(r[1] - 4 * r[0]) <= 1
    r = allocate_ranks([8, 64], 0.5, [1e6, 1.0])  # the first wants more than its width: clamped, saved exactly
    assert r[0] is None and r[1] == 28


def test_bf16_autocast_saves_bf16_sketches_and_returns_fp32_gradients():
    model = tiny_model("llama", layers=2).train()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with compress_activations(model, rank=0.25) as ac:
        ac.set_step(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    s = ac.counter.summary()
    assert s["saved_weight_copy_bytes"] == 0  # the fp32 weight is saved, cast in backward: no bf16 copies held
    assert s["saved_linear_input_bytes"] * 2 == s["saved_linear_input_uncompressed_bytes"] // 2  # bf16 sketch at d/4


def test_a_compiled_module_is_refused():
    with pytest.raises(ValueError, match="torch.compile"):
        with compress_activations(torch.compile(nn.Linear(4, 4)), rank=2):
            pass


# ---- distill integration --------------------------------------------------------------------------


def _distill_cfg(teacher, data_file, tmp_path, **kw):
    from llmcompress.distill import DistillConfig

    base = dict(teacher=str(teacher), keep_layers=2, train_tokens=32 * 4 * 8, data=str(data_file), seq_len=32, batch_size=4,
                eval_tokens=0, cache_dir=str(tmp_path / "cache"), lr=2e-3, phase1_fraction=0.5)
    return DistillConfig(**{**base, **kw})


def test_distill_e2e_with_act_rank_saves_fewer_bytes_and_resumes_bit_identically(tiny_hf_dir, data_file, tmp_path, monkeypatch):
    import json

    from llmcompress.distill import losses as losses_mod
    from llmcompress.distill.engine import distill

    off = distill(_distill_cfg(tiny_hf_dir, data_file, tmp_path, mode="e2e"), tmp_path / "off").metrics["activations"]
    cfg = _distill_cfg(tiny_hf_dir, data_file, tmp_path, mode="e2e", act_rank="auto", act_budget=0.25)
    on = distill(cfg, tmp_path / "on").metrics["activations"]
    assert off["act_rank"] is None and on["act_rank"] == "auto" and on["auto_ranks"]
    assert on["saved_linear_input_uncompressed_bytes"] == off["saved_linear_input_bytes"]  # fp32: X saved once either way
    assert on["saved_linear_input_bytes"] <= 0.3 * off["saved_linear_input_bytes"]
    assert on["saved_decoder_other_bytes"] == off["saved_decoder_other_bytes"]  # non-linear saves untouched
    report = (tmp_path / "on" / "report.md").read_text()
    assert "auto, budget 0.25" in report and "saved-for-backward bytes" in report
    # interrupted after 5 steps (checkpoint after step 4: auto ranks already fixed), resumed: same student
    real, calls = losses_mod.logit_objective, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(losses_mod, "logit_objective", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, tmp_path / "run")
    monkeypatch.setattr(losses_mod, "logit_objective", real)
    distill(cfg, tmp_path / "run", resume=True)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(5)) + list(range(4, 8))
    from safetensors.torch import load_file

    ref, got = (load_file(str(tmp_path / d / "student" / "model.safetensors")) for d in ("on", "run"))
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_distill_layerwise_with_act_rank_trains(tiny_hf_dir, data_file, tmp_path):
    import json

    from llmcompress.distill.engine import distill

    res = distill(_distill_cfg(tiny_hf_dir, data_file, tmp_path, act_rank=8), tmp_path / "out")
    act = res.metrics["activations"]
    assert act["act_rank"] == 8 and 0 < act["saved_linear_input_bytes"] < act["saved_linear_input_uncompressed_bytes"]
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    for phase in (1, 2):
        losses = [r["loss"] for r in log if r["phase"] == phase and r["segment"] == 0]
        assert losses[-1] < losses[0]


def test_a_module_whose_forward_is_replaced_stays_compressible_through_linear():
    """The NAS supernet computes each linear's weight itself and calls actcomp.linear (not F.linear)."""
    from llmcompress.actcomp import linear

    lin, x, delta = _problem()
    scale = torch.tensor(2.0, requires_grad=True)
    lin.forward = lambda inp: linear(lin, inp, lin.weight * scale, lin.bias)
    with compress_activations(lin, rank=8) as ac:
        ac.set_step(0)
        (lin(x.clone().requires_grad_(True)) * delta).sum().backward()
        assert ac.groups == {"": []}
        assert x.shape[0] * 8 * 4 <= ac.counter.step["linear_input"] < x.numel() * 4  # the sketch (+ the scalar), not X
    assert lin.forward is not None and "_actcomp" not in lin.__dict__  # the replaced forward is left alone
    exact = (delta.T @ x * lin.weight).sum()  # d/dscale of sum(y * delta) = <dW_eff, W>
    assert scale.grad is not None and abs(float(scale.grad) - float(exact)) < 3 * abs(float(exact))  # an estimate, finite


def test_nas_search_with_act_rank(tiny_hf_dir, tmp_path):
    """The supernet search runs with sketched linear inputs and keeps the projection state for --resume."""
    import json
    import subprocess
    import sys

    spec = tmp_path / "s.yaml"
    spec.write_text("seq_len: 32\nbatch_size: 2\ncontext_len: 32\ncheckpoint_every: 1\nrefine_evals: 0\nquant_method: rtn\nsearch_steps: 2\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "llmcompress", "nas", str(tiny_hf_dir), "--spec", str(spec), "--target-bits", "4",
                        "--train-tokens", "128", "--eval-tokens", "0", "--baselines", "", "--act-rank", "auto", "--act-budget", "0.25",
                        "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    log = [rec for line in (out / "search_log.jsonl").read_text().splitlines() if (rec := json.loads(line)).get("stage") == "joint"]
    assert len(log) == 2 and all(math.isfinite(rec["kl"]) for rec in log)
    from llmcompress.io.rundir import load_state

    st = load_state(out / "search_state_joint.json")
    assert st["act"]["step"] == 1 and st["act"]["auto_ranks"]  # ranks fixed after the first step, saved for --resume
