"""Compressed collectives on gloo (2 and 3 processes) are bit-identical to the plain reference."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world,ddp_steps", [(2, 2), (3, 0)])
def test_collectives_bit_identical(tmp_path, world, ddp_steps):
    from llmcompress.comm._selftest import run

    results = run(world, str(tmp_path), ddp_steps=ddp_steps)
    for r in results:
        bad = [k for k, ok in r["checks"].items() if not ok]
        assert not bad, f"rank {r['rank']}: not bit-identical for {bad}"
        if ddp_steps:
            d = r["ddp"]
            assert d["compressed_equals_plain"] and d["auto_equals_plain"]
            assert d["compressed_equals_ddp_default"]  # 2 ranks, fp32: same bits as DDP's own all-reduce
            assert d["compressed_buckets"] > 0 and d["auto_decisions"]


def test_strategy_break_even_logic():
    from llmcompress.comm.collectives import Strategy

    s = Strategy(link_MBps=1.0, min_bytes=1024)
    s.codec_stats["torch.bfloat16"] = (1000.0, 2000.0, 0.66)
    assert abs(s.break_even_MBps(__import__("torch").bfloat16) - 0.34 / (1 / 1000 + 1 / 2000)) < 1e-9
    import torch

    assert s.choose(1 << 20, torch.bfloat16) is True  # slow link: compress
    s.link_MBps = 1e6
    assert s.choose(1 << 20, torch.bfloat16) is False  # fast link: plain
    assert s.choose(100, torch.bfloat16) is False  # tiny message: plain
    assert [d["compressed"] for d in s.decisions] == [True, False, False]
