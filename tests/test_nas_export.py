"""NAS on a tiny llama: channel ranking is exact, sliced == zero-padded, HF, GGUF and compressed-tensors exports match,
and a searched architecture respects its targets."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.nas import export as E
from llmcompress.nas.config import NasConfig
from llmcompress.nas.cost import build_cost_models
from llmcompress.nas.search import check_reachable, search_joint, search_sequential, search_uniform
from llmcompress.nas.space import Arch, build_space, mlp_channel_importance, permute_mlp_

IDS = torch.randint(3, TINY_VOCAB, (16, 32), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model, ids=IDS[:2]):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _setup(**kw):
    model = tiny_model("llama", layers=4)
    kw.setdefault("search_steps", None)  # the gradient phase (off by default) is what these tests exercise
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


def _byte_bpe(n: int):
    """A byte-level BPE tokenizer with exactly `n` = 256 tokens (the tiny models' vocabulary): no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == n
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=alphabet[0])


def test_hf_and_exports_match_the_derived_model(tmp_path):
    import json

    import gguf
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, cfg, space = _setup(target_bits=6, bits=[4, 8, 16], export=["gguf", "compressed-tensors"])
    cfg.validate()
    arch = Arch.dense(space, bits_idx=0)
    arch.keep[1] = False
    arch.width = [0, 3, 1, 2]
    arch.bits[0][6] = 1  # an 8-bit layer
    arch.bits[2][0] = 2  # a 16-bit layer
    derived = E.derive_model(model, space, arch)
    plan = E.plan_of(space, arch, sym8=True)
    qw = E.quantize_derived(derived, plan)
    eight = [q for q in qw.values() if q.bits == 8]
    assert eight and all(q.sym for q in eight) and not any(q.sym for q in qw.values() if q.bits == 4)
    tok = _byte_bpe(TINY_VOCAB)
    E.save_hf(derived, tok, tmp_path / "hf", {"method": "test"}, space.intermediate, dtype="float32")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert plain.config.intermediate_size == space.intermediate
    torch.testing.assert_close(logits(plain), logits(derived), rtol=0, atol=1e-5)
    res = E.save_exports(derived, tok, qw, tmp_path, ["gguf", "compressed-tensors"], space.intermediate, "float32", {"method": "test"})
    assert "zero-padded" in res["gguf"]["note"]
    assert not (tmp_path / "packed").exists()
    # GGUF: per-tensor types carry the plan; transformers runs it with the derived model's logits
    r = gguf.GGUFReader(str(tmp_path / "gguf" / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert int(r.fields["llama.block_count"].contents()) == 3
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.1.attn_q.weight"] == "F32"
    assert types["blk.0.attn_q.weight"] == "Q4_1"
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file="model.gguf", dtype=torch.float32).eval()
    ref = logits(derived)
    err = (logits(got) - ref).abs().max() / ref.abs().max()
    assert 0 < err < 5e-3, err  # Q4_1 minimum rounding only (symmetric is exact; per-weight bound: test_export.py)
    # compressed-tensors: its own decompressor gives back the zero-padded weights exactly
    ct = tmp_path / "compressed-tensors"
    qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
    tensors = load_file(str(ct / "model.safetensors"))
    padded = E.zero_padded(derived, space.intermediate)
    for fqn in [f for f, q in qw.items() if q.bits < 16]:
        scheme = next(s for s in qc.config_groups.values() if fqn in s.targets)
        sd = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == fqn}
        w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
        assert torch.equal(w, padded.get_submodule(fqn).weight.detach()), fqn


def test_gguf_export_refuses_bits_it_cannot_store():
    from llmcompress.errors import UserError

    with pytest.raises(UserError, match="cannot store"):
        NasConfig(target_bits=4, export=["gguf"]).validate()  # default bits include 2 and 3
    NasConfig(target_bits=4, bits=[4, 8, 16], export=["gguf"]).validate()
    with pytest.raises(UserError, match="unknown export format"):
        NasConfig(target_bits=4, export=["onnx"]).validate()


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


def _interrupt_at(monkeypatch, step):
    """Make the search stop with KeyboardInterrupt when it logs `step` (after the checkpoint of step - 1)."""
    from llmcompress.nas import search as S

    real = S.append_jsonl

    def flaky(path, rec):
        if rec.get("step") == step:
            raise KeyboardInterrupt
        real(path, rec)

    monkeypatch.setattr(S, "append_jsonl", flaky)
    return real


def test_resume_uses_the_checkpoint(tmp_path, monkeypatch):
    """An interrupted search resumed from its checkpoint ends where an uninterrupted one does, runs only the
    missing steps, and really starts from the saved state: a tampered checkpoint changes the result."""
    import dataclasses

    from llmcompress.io.rundir import load_state, save_state
    from llmcompress.nas import search as S

    model, cfg, space = _setup(target_bits=4.0)
    cfg = dataclasses.replace(cfg, train_tokens=512, checkpoint_every=2, lr=0.5)  # 4 steps
    costs = build_cost_models(model, space, "analytic", 32)
    for d in "abc":
        (tmp_path / d).mkdir()
    full = search_joint(model, space, costs, cfg, IDS, tmp_path / "a", False)

    def interrupted(d):
        real = _interrupt_at(monkeypatch, 3)
        with pytest.raises(KeyboardInterrupt):
            search_joint(model, space, costs, cfg, IDS, tmp_path / d, False)
        monkeypatch.setattr(S, "append_jsonl", real)
        assert load_state(tmp_path / d / "search_state_joint.json")["step"] == 2

    interrupted("b")
    resumed = search_joint(model, space, costs, cfg, IDS, tmp_path / "b", True)
    for k in full.logits:
        torch.testing.assert_close(resumed.logits[k], full.logits[k], rtol=0, atol=1e-6)
    steps = [r["step"] for r in map(__import__("json").loads, (tmp_path / "b" / "search_log.jsonl").read_text().splitlines())]
    assert steps == [1, 2, 3, 4]  # steps 1-2 before the interruption, only 3-4 after it
    # the same interruption, but the saved logits altered: the resumed run must carry the change
    interrupted("c")
    path = tmp_path / "c" / "search_state_joint.json"
    st = load_state(path)
    st["net"]["bits"][0, 0, 0] += 50.0
    save_state(path, st)
    tampered = search_joint(model, space, costs, cfg, IDS, tmp_path / "c", True)
    shift = float(tampered.logits["bits"][0, 0, 0] - full.logits["bits"][0, 0, 0])
    assert 45 < shift < 55  # two more Adam steps of lr 0.5 cannot undo (or fake) a shift of 50


def test_sixteen_bits_cost_no_more_than_dense():
    model, _, space = _setup(target_bits=4, bits=[2, 4, 16])
    costs = build_cost_models(model, space, "analytic", 32)
    m = costs.metrics(Arch.dense(space))  # every linear at 16 bits: the dense float16 model
    assert m["latency"] == pytest.approx(1.0, rel=1e-9)
    assert m["size_mb"] == pytest.approx(sum(p.numel() for p in model.parameters()) * 2 / 1e6, rel=1e-9)


def test_bank_gptq_is_the_exporters_gptq():
    """The bank's GPTQ weights (one Hessian pass of the teacher) are bit for bit what GPTQ-quantizing the
    dense derived model by its plan gives."""
    from llmcompress.nas.qbank import build_bank
    from llmcompress.quant.gptq import gptq_model_

    model, _, space = _setup(target_bits=4.0)
    arch = Arch.dense(space, space.bits.index(3))
    arch.bits[1][2] = space.bits.index(5)
    bank = build_bank(model, space, "gptq", IDS, act_order=True, progress=False)
    shipped = E.apply_bank(E.derive_model(model, space, arch), space, arch, bank)
    direct = gptq_model_(E.derive_model(model, space, arch), E.plan_of(space, arch, method="gptq"), IDS, progress=False, act_order=True)
    assert set(shipped) == set(direct) and len(shipped) == 4 * 7
    for f, q in direct.items():
        assert torch.equal(shipped[f].q, q.q) and torch.equal(shipped[f].scale, q.scale) and shipped[f].bits == q.bits, f


def test_shipped_model_computes_what_the_supernet_scored():
    """Skips, MLP widths and bits of an architecture: the derived model with the bank's weights gives the
    supernet's logits for that architecture (so the validated step's KL is the exported model's KL)."""
    from llmcompress.nas.qbank import build_bank
    from llmcompress.nas.supernet import Supernet

    model, _, space = _setup(target_bits=4.0)
    arch = _some_arch(space)
    bank = build_bank(model, space, "gptq", IDS, act_order=True, progress=False)
    net = Supernet(model, space, bank)
    with net.pinned(arch), torch.no_grad():
        searched = model(input_ids=IDS[:2], use_cache=False).logits
    derived = E.derive_model(model, space, arch)
    E.apply_bank(derived, space, arch, bank)
    torch.testing.assert_close(logits(derived), searched, rtol=1e-5, atol=1e-5)
    assert (logits(derived) - logits(model)).abs().max() > 1e-2  # and it is not the teacher


def test_unreachable_target_is_a_user_error():
    from llmcompress.errors import UserError

    model, cfg, space = _setup(target_latency=0.01)
    costs = build_cost_models(model, space, "analytic", 32)
    with pytest.raises(UserError, match="target-latency 0.01 is below"):
        check_reachable(costs, cfg)
