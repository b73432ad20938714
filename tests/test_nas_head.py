"""The output head (tied embedding/lm_head) in the NAS space (`head_bits`, issue 19): costed in latency, size
and average bits, chosen when a target needs it, scored by the supernet as exported, and shipped in hf/,
compressed-tensors and gguf."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_config

from llmcompress.nas import export as E
from llmcompress.nas.config import NasConfig
from llmcompress.nas.cost import build_cost_models
from llmcompress.nas.qbank import HEAD, build_bank
from llmcompress.nas.search import check_reachable, search_joint
from llmcompress.nas.space import Arch, build_space
from llmcompress.nas.supernet import Supernet

IDS = torch.randint(3, TINY_VOCAB, (12, 32), generator=torch.Generator().manual_seed(3))

pytestmark = pytest.mark.usefixtures("one_thread")


def tied_model():
    import transformers

    cfg = tiny_config("llama", 4)
    cfg.tie_word_embeddings = True
    cfg.vocab_size = 1024  # a head that weighs like a real one (here ~1/3 of the linears' weights)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.fixture(scope="module")
def tiny():
    model = tied_model()
    cfg = NasConfig(bits=[4, 8, 16], head_bits=[4, 8, 16], target_latency=0.5, train_tokens=256, seq_len=32, batch_size=4,
                    context_len=32, refine_blocks=4, quant_method="rtn")
    space = build_space(model, cfg)
    return model, cfg, space, build_cost_models(model, space, "analytic", 32), build_bank(model, space, "rtn", progress=False)


def test_head_is_costed_in_latency_size_and_average_bits(tiny):
    model, _, space, costs, _ = tiny
    assert space.tied and space.head_shape == (1024, 64)
    lin = Arch.dense(space, 0)  # linears and head at 4 bits
    float_head = lin.copy_with_head(space.head_bits.index(16))
    a, b = costs.metrics(lin), costs.metrics(float_head)
    n_lin = sum(space.shapes[n][0] * space.shapes[n][1] for n in space.linears) * space.n_layers
    n_head = 1024 * 64
    assert a["bits"] == pytest.approx(4.0) and b["bits"] == pytest.approx((4 * n_lin + 16 * n_head) / (n_lin + n_head))
    four = (4 + 20 / space.group_size) / 8  # bytes per weight at 4 bits (ints, float16 scale, packed zero)
    assert (b["size_mb"] - a["size_mb"]) * 1e6 == pytest.approx(n_head * (2 - four))
    dense = costs.latency_dense
    assert (b["latency"] - a["latency"]) * dense == pytest.approx(n_head * (2 - four))
    # the all-float architecture is still the dense model
    assert costs.metrics(Arch.dense(space))["latency"] == pytest.approx(1.0)


def test_a_latency_target_below_the_float_head_floor_picks_a_quantized_head(tmp_path, tiny):
    model, cfg, space, costs, bank = tiny
    floor = costs.metrics(Arch.dense(space, 0).copy_with_head(space.head_bits.index(16)))["latency"]
    below = costs.metrics(Arch.dense(space, 0))["latency"]
    assert below < floor
    import dataclasses

    cfg = dataclasses.replace(cfg, target_latency=(below + floor) / 2, search_steps=0)
    check_reachable(costs, cfg)  # reachable only because the head can be quantized
    res = search_joint(model, space, costs, cfg, IDS[:8], tmp_path, False, IDS[8:], bank=bank)
    assert res.arch.head is not None and space.head_bits[res.arch.head] < 16
    assert costs.metrics(res.arch)["latency"] <= cfg.target_latency + 1e-9
    assert res.arch.to_dict(space)["head_bits"] == space.head_bits[res.arch.head]
    # the exported model is what the supernet scored: head and (tied) embedding carry the bank's weights
    derived = E.derive_model(model, space, res.arch)
    qw = E.apply_bank(derived, space, res.arch, bank)
    want = bank.dequant(HEAD, 0, res.arch.head)
    assert torch.equal(derived.get_input_embeddings().weight, want) and "lm_head" in qw
    assert E.plan_of(space, res.arch).config_for("lm_head").bits == space.head_bits[res.arch.head]
    net = Supernet(model, space, bank)
    with net.pinned(res.arch), torch.no_grad():
        searched = model(input_ids=IDS[:2], use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(derived(input_ids=IDS[:2], use_cache=False).logits, searched, rtol=1e-5, atol=1e-5)
        assert not torch.equal(model(input_ids=IDS[:2], use_cache=False).logits, searched)  # the teacher is restored


def test_quantized_head_is_shipped_in_gguf_and_compressed_tensors(tmp_path, tiny):
    import json

    import gguf
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from test_nas_export import _byte_bpe

    model, _, space, _, bank = tiny
    arch = Arch.dense(space, 0)  # 4-bit linears and head
    derived = E.derive_model(model, space, arch)
    qw = E.apply_bank(derived, space, arch, bank)
    tok = _byte_bpe(256)
    res = E.save_exports(derived, tok, qw, tmp_path, ["gguf", "compressed-tensors"], space.intermediate, "float32", {"method": "t"})
    r = gguf.GGUFReader(res["gguf"]["path"])
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "Q4_1" and "output.weight" not in types  # tied: one quantized table
    ct = tmp_path / "compressed-tensors"
    conf = json.loads((ct / "config.json").read_text())
    assert conf["tie_word_embeddings"] is False  # written untied: lm_head packed, embedding its dequantized values
    qc = QuantizationConfig.model_validate(conf["quantization_config"])
    scheme = next(s for s in qc.config_groups.values() if "lm_head" in s.targets)
    tensors = load_file(str(ct / "model.safetensors"))
    sd = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == "lm_head"}
    w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
    assert torch.equal(w, bank.dequant(HEAD, 0, 0)) and torch.equal(tensors["model.embed_tokens.weight"].float(), w)
    assert derived.get_output_embeddings().weight is derived.get_input_embeddings().weight  # the model itself stays tied


def test_validated_step_scores_the_architectures_head(tiny):
    """refine.arch_kl (the validated step's score) computes the head at the architecture's bits, as the export
    ships it, whatever the supernet's head logits are (before, the head stayed a Gumbel sample of its logits)."""
    from llmcompress.nas.refine import arch_kl
    from llmcompress.nas.sensitivity import mean_kl, reference_logp

    model, _, space, _, bank = tiny
    blocks = IDS[:4]
    ref = reference_logp(model, blocks)
    net = Supernet(model, space, bank)  # head logits uniform and learnable: a sample would be a random mix
    kls = []
    for h in range(len(space.head_bits)):
        arch = Arch.dense(space, 1).copy_with_head(h)  # linears at 8 bits, the head at each width
        got = arch_kl(model, net, arch, blocks, ref)
        derived = E.derive_model(model, space, arch)
        E.apply_bank(derived, space, arch, bank)
        assert got == pytest.approx(mean_kl(derived, blocks, ref), rel=1e-4, abs=1e-7)
        kls.append(got)
    assert kls[0] > kls[-1]  # a 4-bit head costs KL that a float head does not
    assert "head" in net.learn  # and the supernet is restored
