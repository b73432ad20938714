"""NAS on a tiny llama: channel ranking is exact, sliced == zero-padded, packed reload and HF export match,
and a searched architecture respects its targets."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.nas import export as E
from llmcompress.nas.config import NasConfig
from llmcompress.nas.cost import build_cost_models
from llmcompress.nas.packed import load_packed
from llmcompress.nas.search import check_reachable, search_joint, search_sequential, search_uniform
from llmcompress.nas.space import Arch, build_space, mlp_channel_importance, permute_mlp_

IDS = torch.randint(3, TINY_VOCAB, (16, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def one_thread():
    # the CPU is shared: tiny ops on 2 contended threads are ~20x slower than on one
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def logits(model, ids=IDS[:2]):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _setup(**kw):
    model = tiny_model("llama", layers=4)
    cfg = NasConfig(cost_model="analytic", train_tokens=256, seq_len=32, batch_size=4, context_len=32, **kw)
    space = build_space(model, cfg)
    return model, cfg, space


def _some_arch(space):
    arch = Arch.dense(space, bits_idx=2)
    arch.keep[1] = False
    arch.width = [0, 3, 1, 2]
    arch.bits[0][6] = 0
    arch.bits[2][0] = 4
    return arch


def test_channel_ranking_keeps_outputs():
    model, _, _ = _setup(target_bits=4)
    before = logits(model)
    imp = mlp_channel_importance(model, IDS[:4])
    permute_mlp_(model, [i.argsort(descending=True) for i in imp])
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)


def test_auto_group_size_and_widths():
    _, _, space = _setup(target_bits=4)
    assert space.widths == [32, 64, 96, 128]
    assert space.group_size == 32  # 128 and 64 do not divide the 32-wide MLP choice


def test_sliced_prefix_equals_zero_padded():
    model, _, space = _setup(target_bits=4)
    derived = E.derive_model(model, space, _some_arch(space))
    assert E.mlp_widths(derived) == [32, 64, 96]
    assert derived.config.num_hidden_layers == 3
    padded = E.zero_padded(derived, space.intermediate)
    torch.testing.assert_close(logits(padded), logits(derived), rtol=0, atol=1e-5)


def test_packed_reload_identical_and_hf_export_matches(tmp_path, tiny_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, space = _setup(target_bits=4)
    arch = _some_arch(space)
    derived = E.derive_model(model, space, arch)
    plan = E.plan_of(space, arch)
    qw = E.quantize_derived(derived, plan)
    assert qw["model.layers.0.mlp.down_proj"].bits == 2 and qw["model.layers.1.self_attn.q_proj"].bits == 16
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    E.save_packed(derived, tok, qw, plan, tmp_path / "packed", {"method": "test"})
    again, tok2 = load_packed(tmp_path / "packed", torch.float32)
    assert tok2 is not None
    assert torch.equal(logits(again), logits(derived))
    E.save_hf(derived, tok, tmp_path / "hf", {"method": "test"}, space.intermediate)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert plain.config.intermediate_size == space.intermediate
    torch.testing.assert_close(logits(plain), logits(derived), rtol=0, atol=1e-5)
    packed_bytes = (tmp_path / "packed" / "model.safetensors").stat().st_size
    hf_bytes = (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert packed_bytes < hf_bytes / 3


def test_size_model_matches_packed_tensors(tmp_path):
    model, cfg, space = _setup(target_bits=4)
    costs = build_cost_models(model, space, "analytic", 32)
    arch = _some_arch(space)
    derived = E.derive_model(model, space, arch)
    plan = E.plan_of(space, arch)
    qw = E.quantize_derived(derived, plan)
    E.save_packed(derived, None, qw, plan, tmp_path / "p", {})
    from safetensors.torch import load_file

    stored = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "p" / "model.safetensors").values())
    assert abs(costs.metrics(arch)["size_mb"] * 1e6 - stored) / stored < 0.01


@pytest.mark.parametrize("mode", ["joint", "sequential", "uniform"])
def test_search_respects_targets(tmp_path, mode):
    model, cfg, space = _setup(target_latency=0.7, target_bits=4.0)
    costs = build_cost_models(model, space, "analytic", 32)
    check_reachable(costs, cfg)
    if mode == "joint":
        res = search_joint(model, space, costs, cfg, IDS, tmp_path, False)
    elif mode == "sequential":
        res = search_sequential(model, space, costs, cfg, IDS, tmp_path, False)
    else:
        res = search_uniform(space, costs, cfg)
    m = costs.metrics(res.arch)
    assert m["bits"] <= 4.0 + 1e-9
    if mode != "uniform":
        assert m["latency"] <= 0.7 + 1e-9
        assert (tmp_path / "search_log.jsonl").is_file()
    else:
        assert res.arch.bits[0][0] == space.bits.index(4)


def test_resume_continues_from_checkpoint(tmp_path):
    import dataclasses

    model, cfg, space = _setup(target_bits=4.0)
    cfg = dataclasses.replace(cfg, train_tokens=512, checkpoint_every=2)  # 4 steps
    costs = build_cost_models(model, space, "analytic", 32)
    full = search_joint(model, space, costs, cfg, IDS, tmp_path / "a", False) if (tmp_path / "a").mkdir() is None else None
    # interrupted run: only the first 2 steps, then resume to 4
    (tmp_path / "b").mkdir()
    short = dataclasses.replace(cfg, train_tokens=256)
    search_joint(model, space, costs, short, IDS, tmp_path / "b", False)
    state = torch.load(tmp_path / "b" / "search_state_joint.pt", weights_only=True)
    state["fingerprint"] = cfg.fingerprint()
    torch.save(state, tmp_path / "b" / "search_state_joint.pt")
    resumed = search_joint(model, space, costs, cfg, IDS, tmp_path / "b", True)
    # tau schedules differ between a 2-step and a 4-step run, so compare structure, not values
    assert torch.load(tmp_path / "b" / "search_state_joint.pt", weights_only=True)["step"] == 4
    assert resumed.logits["bits"].shape == full.logits["bits"].shape


def test_unreachable_target_is_a_user_error():
    from llmcompress.errors import UserError

    model, cfg, space = _setup(target_latency=0.01)
    costs = build_cost_models(model, space, "analytic", 32)
    with pytest.raises(UserError, match="target-latency 0.01 is below"):
        check_reachable(costs, cfg)
