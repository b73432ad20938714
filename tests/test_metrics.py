"""llmcompress.metrics: the KL forms agree with each other and with the definition; Block Influence on known
geometries; tensor digests keep the bytes every existing cache key and manifest digest was made of."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

from llmcompress import metrics


def _logp(*shape, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return F.log_softmax(scale * torch.randn(*shape, generator=g), dim=-1)


def test_token_kl_is_the_definition_and_zero_on_itself():
    p, q = _logp(2, 5, 11), _logp(2, 5, 11, seed=1)
    pd, qd = p.double().exp(), q.double().exp()
    want = (pd * (pd.log() - qd.log())).sum(-1)
    assert torch.allclose(metrics.token_kl(p, q).double(), want, atol=1e-6)
    assert metrics.token_kl(p, p).abs().max() < 1e-6
    assert (metrics.token_kl(p, q) > 0).all()
    assert not torch.allclose(metrics.token_kl(p, q), metrics.token_kl(q, p))  # the direction matters


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_logits_is_the_token_mean_of_token_kl_scaled_by_t2(temperature):
    s, t = 2.0 * torch.randn(3, 4, 13), 2.0 * torch.randn(3, 4, 13)
    lp_s, lp_t = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    want = metrics.token_kl(lp_t, lp_s).mean() * temperature**2
    assert metrics.kl_logits(s, t, temperature).item() == pytest.approx(want.item(), rel=1e-5)


def test_topk_kl_is_exact_with_every_token_and_a_bound_below_with_fewer():
    p, q = _logp(6, 32), _logp(6, 32, seed=2)
    v, i = p.topk(32, dim=-1)
    assert torch.allclose(metrics.topk_kl(q, i, v), metrics.token_kl(p, q), atol=1e-5)
    v8, i8 = p.topk(8, dim=-1)  # the tail bucket merges tokens: KL can only shrink (log-sum inequality)
    assert (metrics.topk_kl(q, i8, v8) <= metrics.token_kl(p, q) + 1e-5).all()
    assert (metrics.topk_kl(q, i8, v8) >= -1e-6).all()


def test_block_influence_on_known_geometries():
    h = torch.randn(2, 7, 16)
    ortho = torch.randn(2, 7, 16)
    ortho = ortho - (ortho * h).sum(-1, keepdim=True) / (h * h).sum(-1, keepdim=True) * h  # orthogonal to h per token
    bi = metrics.block_influence([h, 3.0 * h, -h, ortho])
    assert bi == pytest.approx([0.0, 2.0, 1.0], abs=1e-5)  # same direction, reversed, orthogonal


def test_collapse_and_distill_block_influence_are_the_shared_one():
    from llmcompress.collapse.fitness import block_influence

    states = [torch.randn(3, 5, 8) for _ in range(4)]
    assert block_influence(states) == metrics.block_influence(states)


def _old_cache_key(*parts):  # distill/cache.cache_key before the shared digest (keys on disk were made so)
    import json

    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().contiguous().cpu()
            h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def test_digests_keep_their_bytes_and_see_dtype_and_shape():
    from conftest import tiny_model

    from llmcompress.distill.cache import cache_key
    from llmcompress.io.checkpoint import weights_hash

    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    parts = ("v1", x.t(), [1, 2], torch.arange(5))  # a non-contiguous tensor too
    assert cache_key(*parts) == _old_cache_key(*parts)
    assert cache_key(x) != cache_key(x.reshape(4, 3)) != cache_key(x.double())

    model = tiny_model("llama", layers=2)
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    assert weights_hash(model) == h.hexdigest()


def test_default_threads_respects_the_cap_and_affinity():
    import os

    from llmcompress.runtime import default_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_threads() == cores
    assert default_threads(cap=1) == 1 and default_threads(cap=10_000) == cores
