"""The benchmark's mixed-precision baselines (bench/bench_nas.py) on a tiny llama: each meets its budget and
does what it is named for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

IDS = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(7))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.cost import build_cost_models
    from llmcompress.nas.qbank import build_bank
    from llmcompress.nas.space import build_space

    torch.manual_seed(0)
    model = tiny_model("llama", layers=8)
    space = build_space(model, NasConfig(target_bits=3.0, bits=[2, 3, 4, 5, 6, 8]))
    return model, space, build_cost_models(model, space, "analytic", 32), build_bank(model, space, "rtn", progress=False)


def test_llamacpp_style_raises_v_and_down_in_its_layers(setup):
    import bench_nas as B

    _, space, costs, _ = setup
    targets = {"bits": 3.0}
    arch = B.llamacpp_plan(space, costs, targets, space.bits.index(3))
    assert costs.metrics(arch)["bits"] <= 3.0 + 1e-9
    v, d = space.linears.index("self_attn.v_proj"), space.linears.index("mlp.down_proj")
    more = [i for i in range(space.n_layers) if B.use_more_bits(i, space.n_layers)]
    assert more and all(arch.bits[i][v] > space.bits.index(3) and arch.bits[i][d] > space.bits.index(3) for i in more[:1])
    assert any(min(row) < space.bits.index(3) for row in arch.bits)  # paid for by lowering others


def test_knapsack_follows_the_measured_table(setup):
    import bench_nas as B

    model, space, costs, bank = setup
    table = B.measure_table(model, space, bank, IDS[:2])
    arch = B.knapsack_plan(space, table, 3.0)
    assert costs.metrics(arch)["bits"] <= 3.0 + 1e-9
    # the linear whose 2-bit KL is the largest is not left at 2 bits
    worst = max(((i, j) for i in range(space.n_layers) for j in range(len(space.linears))), key=lambda u: table[f"{u[0]}.{u[1]}.0"])
    assert arch.bits[worst[0]][worst[1]] > 0


def test_evopress_never_ends_worse_than_its_start(setup):
    import bench_nas as B

    from llmcompress.nas.refine import arch_kl
    from llmcompress.nas.sensitivity import reference_logp
    from llmcompress.nas.space import Arch
    from llmcompress.nas.supernet import Supernet

    model, space, costs, bank = setup
    net = Supernet(model, space, bank)
    start = Arch.dense(space, space.bits.index(3))
    arch, kl, used = B.evopress(model, net, space, costs, {"bits": 3.0}, start, IDS[:4], evals=9, lam=4, seed=0)
    ref = reference_logp(model, IDS[:4])
    assert used == 9 and kl <= arch_kl(model, net, start, IDS[:4], ref)
    assert kl == pytest.approx(arch_kl(model, net, arch, IDS[:4], ref), rel=1e-6)
    assert costs.metrics(arch)["bits"] <= 3.0 + 1e-9
