"""Co-compression's optimizer step from factors (optim.py), the chunked cross-entropy (loss.py), and the
compressed linear under bf16 autocast (no autocast weight-cache copies, the sketch saved instead of X)."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from llmcompress.actcomp import compress_activations
from llmcompress.actcomp.loss import causal_lm_loss, chunked_cross_entropy
from llmcompress.actcomp.optim import FactoredStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 8), nn.LayerNorm(8))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)


def _loss(net, step):
    x, y = _batch(step)
    return ((net(x) - y) ** 2).mean()


def _run(make_opt, factored: bool, steps=3, clip=None, rank=6):
    """Train `_net` for `steps` with co-compression: through FactoredStep, or (reference) with the factored
    gradients materialised into .grad and the stock optimizer (and torch's clip_grad_norm_)."""
    net = _net()
    opt = make_opt(net.parameters())
    norms = []
    with compress_activations(net, rank=rank, co_compress=True) as ac:
        fs = FactoredStep(opt, ac)
        for step in range(steps):
            ac.set_step(step)
            _loss(net, step).backward()
            assert all(m.weight.grad is None for m in net if isinstance(m, nn.Linear))  # factored, not dense
            if factored:
                if clip:
                    norms.append(float(fs.clip_grad_norm_(clip)))
                fs.step()
                fs.zero_grad()
            else:
                ac.materialize()
                if clip:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
                opt.step()
                opt.zero_grad(set_to_none=True)
    return net, fs, norms


def _close(a: nn.Module, b: nn.Module, tol):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max() <= tol * (1 + q.abs().max()), n


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_through_factored_step_is_the_dense_sgd_step_on_the_sketched_gradient(momentum):
    """Without momentum: applied from U, V, no dense gradient at all; with it: one dense gradient at a time."""
    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.05, weight_decay=0.01, momentum=momentum)

    ref, _, _ = _run(sgd, factored=False)
    got, fs, _ = _run(sgd, factored=True)
    _close(got, ref, 1e-5)
    assert fs.materialized == (3 if momentum else 0)
    assert (fs.peak_dense_grad_bytes > 0) == bool(momentum)
    assert (got[0].weight - _net()[0].weight).abs().max() > 1e-3  # it did step


@pytest.mark.parametrize("clip", [None, 0.5])
def test_adamw_from_factors_equals_torch_adamw_on_the_materialised_gradient(clip):
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)

    ref, _, ref_norms = _run(adamw, factored=False, steps=4, clip=clip)
    got, fs, norms = _run(adamw, factored=True, steps=4, clip=clip)
    _close(got, ref, 1e-5)
    if clip:
        assert norms == pytest.approx(ref_norms, rel=1e-5) and max(norms) > clip  # clipping was active
    assert fs.materialized == 3
    moved = _net()
    assert (got[2].weight - moved[2].weight).abs().max() > 1e-2


def test_only_one_dense_gradient_is_alive_at_a_time():
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    weights = [m.weight for m in net if isinstance(m, nn.Linear)]
    alive, stepped = [], []
    orig = opt.step

    def watched(*a, **k):  # at every optimizer.step: which factored weights hold a dense .grad now
        alive.append(sum(w.grad is not None for w in weights))
        stepped.append([p for g in opt.param_groups for p in g["params"] if p.grad is not None])
        return orig(*a, **k)

    opt.step = watched
    with compress_activations(net, rank=6, co_compress=True) as ac:
        fs = FactoredStep(opt, ac)
        ac.set_step(0)
        _loss(net, 0).backward()
        fs.step()
    assert max(alive) == 1 and alive.count(1) == len(weights)
    assert len(stepped[0]) == 5  # the dense step: 3 biases and the LayerNorm's two, no linear weight
    assert all(len(s) == 1 for s in stepped[1:])  # then each linear weight alone
    largest = max(w.numel() * 4 for w in weights)
    assert fs.peak_dense_grad_bytes == largest < sum(w.numel() * 4 for w in weights)
    assert all(w.grad is None for w in weights) and not ac.factors


def test_a_factored_weight_outside_the_optimizer_is_an_error():
    net = _net()
    opt = torch.optim.AdamW(list(net.parameters())[2:], lr=1e-3)  # net[0].weight and bias left out
    with compress_activations(net, rank=6, co_compress=True) as ac:
        fs = FactoredStep(opt, ac)
        ac.set_step(0)
        _loss(net, 0).backward()
        with pytest.raises(ValueError, match="not in the optimizer"):
            fs.step()


def _head_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 37, 16, generator=g)
    w, b = torch.randn(300, 16, generator=g) / 2, torch.randn(300, generator=g)
    t = torch.randint(0, 300, (2, 37), generator=g)
    t[0, :5] = -100  # ignored rows
    return h, w, b, t


def _stock_and_chunked(h, w, b, t, train_head, autocast, **kw):
    """(loss, grads) of the stock head + F.cross_entropy (logits upcast to fp32, as HF's loss) and of
    chunked_cross_entropy, both under bf16 autocast or neither; the loss is scaled by 3 before backward."""
    out = []
    for chunked in (False, True):
        args = [x.clone().requires_grad_(train_head or x is h) for x in (h, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if chunked:
                loss = chunked_cross_entropy(args[0], args[1], t, bias=args[2], **kw)
            else:
                logits = F.linear(args[0], args[1], args[2]).float()
                loss = F.cross_entropy(logits.reshape(-1, 300), t.reshape(-1), ignore_index=-100)
        (loss * 3).backward()
        out.append((loss, [a.grad for a in args]))
    return out


@pytest.mark.parametrize("impl", ["torch", "chunked"])
@pytest.mark.parametrize("train_head", [True, False])
def test_chunked_cross_entropy_equals_cross_entropy_in_loss_and_gradients(impl, train_head):
    if impl == "torch" and not hasattr(F, "linear_cross_entropy"):
        pytest.skip("this torch has no F.linear_cross_entropy")
    (ref, ref_g), (got, got_g) = _stock_and_chunked(*_head_case(), train_head, autocast=False, impl=impl, chunk_rows=8)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=1e-5)
    for a, c in zip(ref_g, got_g):
        if a is not None:
            assert (a - c).abs().max() <= 1e-5 * (1 + a.abs().max())
        else:
            assert c is None


@pytest.mark.parametrize("train_head", [True, False])
def test_chunked_cross_entropy_under_bf16_autocast_is_the_stock_bf16_head_and_loss(train_head):
    """Under autocast the head matmuls run in bf16 like the stock head's: the loss agrees with the stock
    path's (same bf16 logits) far closer than with the fp32 loss; the gradients to bf16 rounding (measured
    0.2-0.6% of the largest entry, as far as either is from the fp32 gradients; bound 2%)."""
    case = _head_case(1)
    (ref, ref_g), (got, got_g) = _stock_and_chunked(*case, train_head, autocast=True, chunk_rows=8)
    (f32, f32_g), _ = _stock_and_chunked(*case, train_head, autocast=False)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=1e-4)
    assert abs(ref.item() - f32.item()) > 10 * abs(got.item() - ref.item())  # bf16 logits, as the stock head's
    for a, c, e in zip(ref_g, got_g, f32_g):
        if a is None:
            assert c is None
            continue
        assert c.dtype == torch.float32
        assert (a - c).abs().max() <= 2e-2 * a.abs().max()
        assert (a - e).abs().max() > 1e-3 * a.abs().max()  # the control: bf16 rounding is visible at all


def test_the_chunked_function_never_makes_a_tokens_by_vocabulary_tensor_and_multiplies_in_bf16():
    n, d, v = 256, 16, 512
    h, w = torch.randn(n, d, requires_grad=True), torch.randn(v, d, requires_grad=True)
    t = torch.randint(0, v, (n,))
    biggest, mm_dtypes = [], set()

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out):
                mm_dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    biggest.append(o.numel())
            return out

    with Sizes(), torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_cross_entropy(h, w, t, chunk_rows=32).backward()
    assert max(biggest) <= 32 * v and mm_dtypes == {torch.bfloat16}
    biggest.clear()
    with Sizes():
        F.cross_entropy(F.linear(h, w), t).backward()
    assert max(biggest) >= n * v  # the control: the stock path does make one


@pytest.mark.parametrize("autocast", [False, True])
def test_causal_lm_loss_is_the_models_loss_and_gradient(autocast):
    model = tiny_model("llama", layers=2).train()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 10:] = -100  # padding: ignored, after the shift by one
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = causal_lm_loss(model, ids, labels)
    got.backward()
    tol = 2e-2 if autocast else 1e-4  # bf16: the head's matmuls in bf16 in both, rows in other blocks
    assert got.item() == pytest.approx(ref.item(), rel=tol / 10)
    for n, p in model.named_parameters():
        assert (p.grad - ref_g[n]).abs().max() <= tol * (1 + ref_g[n].abs().max()), n


class _Casts(TorchDispatchMode):
    """Weak references to every cast copy of the given parameters."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.ptrs:
            self.refs.append(weakref.ref(out))
        return out

    def alive(self):
        return sum(r() is not None for r in self.refs)


@pytest.mark.parametrize("compressed", [True, False])
def test_under_bf16_autocast_no_weight_copy_stays_alive_and_the_sketch_is_saved(compressed):
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    params = list(net.parameters())
    with compress_activations(net, rank=8 if compressed else None) as ac:
        ac.set_step(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with _Casts(params) as casts:
                y = net(x)
            assert len(casts.refs) >= 2  # the weights were cast to bf16 for the forward
            if compressed:
                assert casts.alive() == 0  # freed at once: no autocast weight-cache copies
                s = ac.counter.step
                assert s["linear_input"] == 2 * 32 * 8 * 2  # two bf16 sketches N x r, not X (N x 64)
                assert s["weight_copy"] == 0
            else:
                assert casts.alive() >= 2  # the control: stock autocast keeps its cached copies
        y.float().sum().backward()
    assert net[0].weight.grad.dtype == torch.float32 and net[0].weight.grad.abs().sum() > 0


# ---- --act-grad factored: the CLI option of co-compression (distill) ---------------------------------


def _train_text(tmp_path):
    import random

    rng = random.Random(0)
    words = ["the cat", "a dog", "sat on", "the mat", "ran far", "and then", "it was", "very good"]
    path = tmp_path / "train.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return path


def _distill_cli(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, ["distill", *map(str, args)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("mode", ["e2e", "layerwise"])
def test_distill_act_grad_factored_steps_adamw_from_the_factors(mode, tiny_hf_dir, tmp_path, capsys, monkeypatch):
    """Through the CLI: with --act-grad factored every training step goes through FactoredStep, the sketched
    linears are stepped from their factors, and no two of their dense gradients are ever alive together."""
    import json

    from llmcompress.actcomp import optim

    steps, items = [], []
    real_step = optim.FactoredStep.step

    def spy(self):
        items.append(len(self.compressor.factors))
        steps.append(1)
        return real_step(self)

    monkeypatch.setattr(optim.FactoredStep, "step", spy)
    out = tmp_path / "out"
    code, err = _distill_cli(capsys, tiny_hf_dir, "--keep-layers", 2, "--mode", mode, "--train-tokens", 32 * 4 * 4,
                             "--data", _train_text(tmp_path), "--seq-len", 32, "--batch-size", 4, "--eval-tokens", 0,
                             "--cache-dir", tmp_path / "cache", "--act-rank", 8, "--act-grad", "factored", "--out", out)
    assert code == 0, err
    act = json.loads((out / "metrics.json").read_text())["activations"]
    assert act["act_grad"] == "factored" and steps and all(n > 0 for n in items)  # every step had factored gradients
    n = act["factored_weights"]
    assert n == max(items) >= 4  # q/k/v/gate/up/down of a layer at least (o_proj's input may be held, exact)
    from safetensors.torch import load_file

    sd = load_file(str(out / "student" / "model.safetensors"))
    largest = max(v.numel() * 4 for k, v in sd.items() if k.endswith("proj.weight"))
    assert 0 < act["factored_peak_dense_grad_bytes"] <= largest  # one linear's dense gradient at a time
    assert "linears stepped from their factors" in (out / "report.md").read_text()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in log)


@pytest.mark.parametrize("args,needle", [
    (["--act-grad", "banana", "--act-rank", "8"], "--act-grad"),
    (["--act-grad", "factored"], "--act-grad factored keeps the sketched weight gradients as factors"),
])
def test_distill_act_grad_bad_values_exit_2_in_one_line(args, needle, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _distill_cli(capsys, "/no/such/model", "--keep-layers", 2, *args, "--out", out)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and lines[0].startswith("error: "), err
    assert not out.exists()


def test_act_grad_factored_is_refused_under_torchrun_before_anything_is_written(tmp_path):
    from llmcompress.dist import DistInfo
    from llmcompress.distill import DistillConfig
    from llmcompress.distill.engine import distill
    from llmcompress.errors import UserError

    cfg = DistillConfig(teacher="/no/such/model", keep_layers=2, act_rank=8, act_grad="factored")
    with pytest.raises(UserError, match="single process"):
        distill(cfg, tmp_path / "out", dist=DistInfo(0, 2, "gloo"))
    assert not (tmp_path / "out").exists()
