"""GGUF and compressed-tensors exports of tiny models: blocks, read-back, transformers loads them.

Tolerances (stated once, asserted below):
* symmetric weights (Q4_0 / Q5_0 / Q8_0): the GGUF dequantizes to exactly our dequantized weights;
* asymmetric weights (Q4_1 / Q5_1): each weight differs by at most 2**-11 |m| + 2**-24 |w| + 2**-25, from
  the float16 rounding of the block minimum m = -z * s (half an ulp; 2**-25 in the subnormal range) and the
  float32 rounding of d * q + m; exactly equal in every block where -z * s is a float16 value;
* logits of transformers' load of our file vs the in-torch quantized model, relative to the largest logit:
  1e-6 when every weight is exact (symmetric), below 5e-3 (and not 0) for asymmetric GGUF (measured 1.5e-3
  on a 3-layer tiny llama; only the block minima differ); compressed-tensors
  1e-5 absolute (its decompression is exact, float32 scales).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmcompress.quant import primitives as P
from llmcompress.quant.apply import QuantizedWeight, quantize_model_
from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

gguf = pytest.importorskip("gguf")


def _qw(bits, group, sym, out=16, inp=256, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[0, :group] = torch.linspace(0.0, 0.3, group)  # a group whose minimum is 0: z = 0, m exactly representable
    q, s, z = P.quantize(w, bits, group, sym=sym)
    return QuantizedWeight(q, s, z, bits, group, sym)


@pytest.mark.parametrize("bits,sym,tname", [(4, True, "Q4_0"), (4, False, "Q4_1"), (5, True, "Q5_0"), (5, False, "Q5_1"),
                                            (8, True, "Q8_0")])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_ggml_blocks_dequantize_to_our_weights(bits, sym, tname, group):
    from llmcompress.export.gguf import pack_ggml_blocks

    qw = _qw(bits, group, sym)
    packed, name = pack_ggml_blocks(qw)
    assert name == tname
    ours = qw.dequantize().numpy()
    theirs = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[tname]).reshape(ours.shape)
    if sym:
        np.testing.assert_array_equal(theirs, ours)
        return
    rep = group // 32
    s = qw.scale.double().repeat_interleave(rep, 1)
    m = -qw.zero.double().repeat_interleave(rep, 1) * s  # (out, blocks)
    bound = (2.0**-11 * m.abs()).repeat_interleave(32, 1).numpy() + 2.0**-24 * np.abs(ours) + 2.0**-25
    err = np.abs(theirs.astype(np.float64) - ours)
    assert (err <= bound).all(), float((err - bound).max())
    exact = (m.to(torch.float16).double() == m).repeat_interleave(32, 1).numpy()
    assert exact[0, :32].all()  # the block with z = 0
    np.testing.assert_array_equal(theirs[exact], ours[exact])
    assert (err[~exact] > 0).any()  # the bound is about real rounding, not vacuous


def test_gguf_refuses_what_llama_cpp_cannot_run():
    from llmcompress.errors import UserError
    from llmcompress.export.gguf import pack_ggml_blocks

    with pytest.raises(UserError, match="no 3-bit block"):
        pack_ggml_blocks(_qw(3, 32, False))
    with pytest.raises(UserError, match="asymmetric 8-bit"):
        pack_ggml_blocks(_qw(8, 32, False))


def test_symmetric_quantization_is_q4_0_convention():
    qw = _qw(4, 32, True)
    assert (qw.zero == 8).all() and qw.q.min() >= 0 and qw.q.max() <= 15
    w = qw.dequantize()
    # the largest magnitude of each group lands within half a step of the grid's ends: s = absmax / 7.5
    absmax = w.reshape(16, -1, 32).abs().amax(-1)
    assert torch.all(absmax <= 8 * qw.scale + 1e-7)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A tiny byte-level BPE tokenizer (the kind convert_hf_to_gguf.py writes as tokenizer.ggml.model 'gpt2')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 20, "hello world, compression! " * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _tiny(vocab: int, layers: int = 2, seed: int = 0, tied: bool = True):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, max_position_embeddings=256,
                                   tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's q/k row permutation."""
    return x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


@pytest.mark.parametrize("sym", [True, False])
def test_gguf_reads_back_and_transformers_runs_it(tmp_path, bpe_tokenizer, sym):
    from transformers import AutoModelForCausalLM

    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf

    model = _tiny(len(bpe_tokenizer))
    qweights, info = quantize_for_export(model, bpe_tokenizer, "gguf", ExportOptions(bits=4, group_size=64, sym=sym), progress=False)
    res = write_gguf(model, tmp_path / "m.gguf", qweights=qweights, float_dtype="float32", tokenizer=bpe_tokenizer)
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    q4 = "Q4_0" if sym else "Q4_1"
    assert types["blk.0.attn_q.weight"] == q4 and types["blk.1.ffn_down.weight"] == q4
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types  # tied: llama.cpp reuses token_embd
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert int(r.fields["llama.block_count"].contents()) == 2
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == len(bpe_tokenizer)
    assert res["tensor_types"][q4] == 14
    # every tensor dequantizes to the in-torch quantized model's weight (q/k rows un-permuted)
    state = model.state_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight":
            continue
        rt = next(x for x in r.tensors if x.name == names.get_name(hf_name, try_suffixes=(".weight",)))
        deq = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(t.shape)
        if hf_name.endswith("q_proj.weight"):
            deq = _unpermute(deq, 4)
        elif hf_name.endswith("k_proj.weight"):
            deq = _unpermute(deq, 2)
        err = np.abs(deq - t.numpy()).max()
        assert err == 0 if (sym or rt.tensor_type.name in ("Q8_0", "F32")) else err <= 2.0**-11 * 2 * np.abs(t.numpy()).max(), hf_name
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([bpe_tokenizer.encode("the quick brown fox jumps over the lazy dog")])
    with torch.no_grad():
        ref, got = model(ids).logits, loaded(ids).logits
    assert ref.abs().max() > 0.1
    err = (got - ref).abs().max() / ref.abs().max()
    assert err <= 1e-6 if sym else 0 < err < 5e-3, err


def test_gguf_bf16_source_dtype_and_q8_0(tmp_path, bpe_tokenizer):
    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf

    model = _tiny(len(bpe_tokenizer), tied=False)
    qweights, _ = quantize_for_export(model, bpe_tokenizer, "gguf", ExportOptions(bits=8), progress=False)
    assert all(q.sym and q.bits == 8 for q in qweights.values())  # --bits 8 alone: Q8_0
    write_gguf(model, tmp_path / "a.gguf", qweights=qweights, float_dtype="bfloat16", tokenizer=bpe_tokenizer)
    r = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["output.weight"] == "Q8_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    dense = _tiny(len(bpe_tokenizer), tied=False)
    write_gguf(dense, tmp_path / "b.gguf", float_dtype="bfloat16", tokenizer=bpe_tokenizer)
    r = gguf.GGUFReader(str(tmp_path / "b.gguf"))
    t = next(x for x in r.tensors if x.name == "blk.0.ffn_up.weight")
    assert t.tensor_type.name == "BF16"
    w = dense.model.layers[0].mlp.up_proj.weight.detach()
    np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape),
                                  w.to(torch.bfloat16).float().numpy())


def test_gguf_file_mode_follows_the_umask(tmp_path, bpe_tokenizer):
    """The GGUF file is written through io/atomic.atomic_path: mode 0666 less the umask, no temp left."""
    import os
    import stat

    from llmcompress.export.gguf import write_gguf

    old = os.umask(0o002)
    try:
        write_gguf(_tiny(len(bpe_tokenizer)), tmp_path / "m.gguf", float_dtype="float32", tokenizer=bpe_tokenizer)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.gguf").stat().st_mode) == 0o664
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_checkpoint(tmp_path, sym):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from llmcompress.export.compressed_tensors import write_compressed_tensors

    model = _tiny(256)
    plan = MixedPrecisionPlan()
    plan[r"re:.*layers\.0\..*"] = QuantConfig(bits=4, group_size=32, sym=sym)
    plan[r"re:.*layers\.1\..*"] = QuantConfig(bits=8, group_size=64, sym=sym)
    plan["_default"] = None
    qweights = quantize_model_(model, plan, progress=False)
    write_compressed_tensors(model, None, tmp_path / "ct", qweights=qweights, float_dtype="float32")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.format == "pack-quantized" and qc.quant_method == "compressed-tensors"
    assert {(s.weights.num_bits, s.weights.group_size, s.weights.symmetric) for s in qc.config_groups.values()} == {(4, 32, sym), (8, 64, sym)}
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    # compressed-tensors' own decompressor gives back exactly our dequantized weights
    for fqn, qw in qweights.items():
        scheme = next(s for s in qc.config_groups.values() if fqn in s.targets)
        sd = {k.split(".")[-1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == fqn}
        assert "weight" not in sd and sd["weight_packed"].dtype == torch.int32
        assert ("weight_zero_point" in sd) == (not sym)
        w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        torch.testing.assert_close(w.float(), qw.dequantize(), atol=0, rtol=0)
    nbytes = (tmp_path / "ct" / "model.safetensors").stat().st_size
    assert nbytes < 0.5 * sum(p.numel() for p in model.parameters()) * 4
    if sym:  # transformers 5 + compressed-tensors 0.20 cannot load asymmetric pack-quantized (llm-compressor#1618)
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32).eval()
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_export_cli_errors_write_nothing(tmp_path, tiny_hf_dir, capsys):
    from llmcompress.cli import main

    for args, msg in [(["--to", "gguf", "--bits", "3"], "--bits 3"), (["--to", "onnx"], "unknown export format"),
                      (["--to", "gguf", "--group-size", "48"], "--group-size 48"), (["--to", "gguf", "--embed-bits", "5"], "--embed-bits 5"),
                      (["--to", "compressed-tensors", "--embed-bits", "4"], "--embed-bits applies to --to gguf"),
                      (["--to", "compressed-tensors", "--separate-output"], "--separate-output applies to --to gguf"),
                      # compressed-tensors' default group of 128 does not divide the tiny model's width of 64 (nor smollm2's 576)
                      (["--to", "compressed-tensors"], "--group-size 128 does not divide the input width 64"),
                      (["--to", "compressed-tensors", "--max-memory", "0"], "--group-size 128 does not divide the input width 64")]:
        with pytest.raises(SystemExit) as e:
            main(["export", str(tiny_hf_dir), "--out", str(tmp_path / "x.gguf"), *args])
        assert e.value.code == 2, args
        # a streamed export says first that it streams (one notice line), then fails in one line
        err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if not ("--max-memory" in args and ln.startswith("notice: ")))
        assert err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.glob("x*"))


def test_export_cli_gguf_embed_bits(tmp_path, bpe_tokenizer, capsys):
    """--embed-bits 4: the (tied) embedding as Q4_0, exactly our 4-bit symmetric RTN of it; --bits 16 --embed-bits 8:
    float linears, Q8_0 embedding; default: Q8_0 when quantizing; --separate-output: the tied matrix written
    twice, as token_embd and as output.weight, same type and bytes."""
    from llmcompress.cli import main
    from llmcompress.quant import primitives as P

    src = tmp_path / "src"
    model = _tiny(len(bpe_tokenizer))
    model.save_pretrained(src)
    bpe_tokenizer.save_pretrained(src)
    types = {}
    for name, args in [("e4", ["--bits", "4", "--sym", "--embed-bits", "4"]), ("e8", ["--bits", "16", "--embed-bits", "8"]),
                       ("default", ["--bits", "4", "--sym"]), ("sep", ["--bits", "4", "--sym", "--embed-bits", "4", "--separate-output"])]:
        with pytest.raises(SystemExit) as e:
            main(["export", str(src), "--to", "gguf", "--out", str(tmp_path / f"{name}.gguf"), *args])
        assert e.value.code == 0, capsys.readouterr().err
        r = gguf.GGUFReader(str(tmp_path / f"{name}.gguf"))
        types[name] = {t.name: t.tensor_type.name for t in r.tensors}
        if name == "e4":
            emb = next(t for t in r.tensors if t.name == "token_embd.weight")
            w = model.model.embed_tokens.weight.detach()
            ref = P.dequantize(*P.quantize(w, 4, 32, sym=True), 32)
            np.testing.assert_array_equal(gguf.quants.dequantize(emb.data, emb.tensor_type).reshape(w.shape), ref.numpy())
        if name == "sep":
            emb, head = (next(t for t in r.tensors if t.name == n) for n in ("token_embd.weight", "output.weight"))
            np.testing.assert_array_equal(np.asarray(head.data), np.asarray(emb.data))
    assert types["e4"]["token_embd.weight"] == "Q4_0" and types["e4"]["blk.0.attn_q.weight"] == "Q4_0"
    assert types["e8"]["token_embd.weight"] == "Q8_0" and types["e8"]["blk.0.attn_q.weight"] == "F32"
    assert types["default"]["token_embd.weight"] == "Q8_0" and "output.weight" not in types["default"]
    assert types["sep"]["output.weight"] == types["sep"]["token_embd.weight"] == "Q4_0"
    assert (tmp_path / "sep.gguf").stat().st_size > (tmp_path / "e4.gguf").stat().st_size


def test_gptq_separate_output_gets_its_own_gptq_integers(tmp_path, bpe_tokenizer, capsys):
    """--quant gptq --embed-bits 4 --separate-output: token_embd stays our RTN of the embedding, output.weight is
    the head's own GPTQ integers, whose error on the final hidden states (what the head multiplies) is below RTN's."""
    from llmcompress.cli import main

    src, text = tmp_path / "src", tmp_path / "calib.txt"
    model = _tiny(len(bpe_tokenizer))
    model.save_pretrained(src)
    bpe_tokenizer.save_pretrained(src)
    words = "the quick brown fox jumps over the lazy dog hello world compression".split()
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(words, 40)) for _ in range(400)))
    out = tmp_path / "m.gguf"
    with pytest.raises(SystemExit) as e:
        main(["export", str(src), "--to", "gguf", "--out", str(out), "--bits", "4", "--sym", "--quant", "gptq",
              "--calib-data", str(text), "--embed-bits", "4", "--separate-output"])
    assert e.value.code == 0, capsys.readouterr().err
    r = gguf.GGUFReader(str(out))
    t = {x.name: x for x in r.tensors}
    assert t["token_embd.weight"].tensor_type.name == t["output.weight"].tensor_type.name == "Q4_0"
    w = model.model.embed_tokens.weight.detach()
    deq = {n: torch.from_numpy(np.array(gguf.quants.dequantize(t[n].data, t[n].tensor_type)).reshape(w.shape)) for n in t
           if n in ("token_embd.weight", "output.weight")}
    rtn = P.dequantize(*P.quantize(w, 4, 32, sym=True), 32)
    assert torch.equal(deq["token_embd.weight"], rtn)
    assert not torch.equal(deq["output.weight"], rtn)
    ids = bpe_tokenizer(text.read_text()[:4000], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        x = model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm: the head's input
    err = lambda q: (x @ (q - w).T).pow(2).sum().item()  # noqa: E731
    assert err(deq["output.weight"]) < 0.9 * err(rtn)


def test_export_cli_compressed_tensors_from_hf_dir(tmp_path, tiny_hf_dir, capsys):
    from llmcompress.cli import main

    out = tmp_path / "ct"
    with pytest.raises(SystemExit) as e:
        main(["export", str(tiny_hf_dir), "--to", "compressed-tensors", "--bits", "4", "--group-size", "32", "--sym",
              "--out", str(out), "--json"])
    assert e.value.code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["float_dtype"] == "float32"  # the tiny source was saved in float32
    manifest = json.loads((out / "llmcompress.json").read_text())
    assert manifest["bytes_on_disk"] == (out / "model.safetensors").stat().st_size
    assert manifest["export"]["plan"]["entries"]


def _header_dtypes(path) -> set[str]:
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_saved_dtype_follows_source_and_save_dtype_overrides(tmp_path, tiny_hf_dir):
    from llmcompress.io.checkpoint import save_checkpoint
    from llmcompress.io.dtypes import save_dtype_for
    from llmcompress.io.load import load_model

    bf16_src = tmp_path / "bf16-src"
    m = _tiny(256, tied=False)
    m.to(torch.bfloat16).save_pretrained(bf16_src)
    lm = load_model(str(bf16_src))  # computes in float32
    assert next(lm.model.parameters()).dtype == torch.float32 and lm.source_dtype == "bfloat16"
    save_checkpoint(lm.model, None, tmp_path / "a", manifest={"method": "t"}, dtype=save_dtype_for(lm))
    save_checkpoint(lm.model, None, tmp_path / "b", manifest={"method": "t"}, dtype=save_dtype_for(lm, "float32"))
    save_checkpoint(lm.model, None, tmp_path / "c", manifest={"method": "t"}, dtype=save_dtype_for(lm, "float16"))
    assert next(lm.model.parameters()).dtype == torch.float32  # the caller's model is not cast
    assert _header_dtypes(tmp_path / "a" / "model.safetensors") == {"BF16"}
    assert _header_dtypes(tmp_path / "b" / "model.safetensors") == {"F32"}
    assert _header_dtypes(tmp_path / "c" / "model.safetensors") == {"F16"}
    a, b = (json.loads((tmp_path / d / "llmcompress.json").read_text()) for d in "ab")
    assert a["dtype"] == "bfloat16" and a["parameters"] == b["parameters"]
    assert a["bytes_on_disk"] == (tmp_path / "a" / "model.safetensors").stat().st_size
    assert a["bytes_on_disk"] <= 0.51 * b["bytes_on_disk"]
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_model(str(tmp_path / "a"))
    assert again.source_dtype == "bfloat16"
    ref = lm.model.model.layers[0].mlp.up_proj.weight.detach().to(torch.bfloat16).float()
    assert torch.equal(again.model.model.layers[0].mlp.up_proj.weight.detach(), ref)
    assert load_model(str(tiny_hf_dir)).source_dtype == "float32"


def test_gguf_source_is_bfloat16():
    from llmcompress.io.dtypes import detect_source_dtype

    assert detect_source_dtype("alias", "smollm2-135m") == "bfloat16"


def test_collapse_and_distill_configs_take_save_dtype():
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.distill import DistillConfig
    from llmcompress.errors import UserError

    CollapseConfig(pareto=True, save_dtype="float16").validate()
    with pytest.raises(UserError, match="unknown save dtype"):
        CollapseConfig(pareto=True, save_dtype="int8").validate()
    with pytest.raises(UserError, match="unknown save dtype"):
        DistillConfig(keep_layers=2, save_dtype="fp8")


def test_old_packed_folder_is_refused(tmp_path, tiny_hf_dir):
    import shutil

    from llmcompress.errors import UserError
    from llmcompress.io.load import load_model

    old = tmp_path / "packed"
    shutil.copytree(tiny_hf_dir, old)
    (old / "packed.json").write_text("{}")
    with pytest.raises(UserError, match="old llmcompress packed checkpoint"):
        load_model(str(old))


def test_export_with_a_nas_plan(tmp_path, bpe_tokenizer):
    from llmcompress.errors import UserError
    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf

    model = _tiny(len(bpe_tokenizer))
    plan = MixedPrecisionPlan()
    plan["model.layers.0.mlp.down_proj"] = QuantConfig(bits=8, group_size=64)  # nas plans are asymmetric
    plan["model.layers.1.self_attn.q_proj"] = QuantConfig(bits=16, group_size=64)
    plan[r"re:.*layers.*"] = QuantConfig(bits=4, group_size=64)
    plan["_default"] = None
    (tmp_path / "arch.json").write_text(json.dumps({"plan": plan.to_dict()}))
    qweights, info = quantize_for_export(model, bpe_tokenizer, "gguf", ExportOptions(plan=tmp_path / "arch.json"), progress=False)
    assert qweights["model.layers.0.mlp.down_proj"].sym and "model.layers.1.self_attn.q_proj" not in qweights
    assert any("down_proj: 8-bit quantized symmetric" in n for n in info["notes"])
    write_gguf(model, tmp_path / "m.gguf", qweights=qweights, float_dtype="float16", tokenizer=bpe_tokenizer)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert (types["blk.0.ffn_down.weight"], types["blk.1.attn_q.weight"], types["blk.1.attn_k.weight"]) == ("Q8_0", "F16", "Q4_1")
    plan["model.layers.0.mlp.up_proj"] = QuantConfig(bits=3, group_size=64)
    (tmp_path / "bad.json").write_text(json.dumps({"plan": plan.to_dict()}))
    with pytest.raises(UserError, match="up_proj: GGUF has no 3-bit block"):
        quantize_for_export(_tiny(len(bpe_tokenizer)), bpe_tokenizer, "gguf", ExportOptions(plan=tmp_path / "bad.json"), progress=False)


@pytest.mark.slow
def test_smollm2_gguf_export_tokenizer_size_and_logits(tmp_path, smollm2):
    """The real model at 4-bit symmetric groups of 32 (Q4_0, embedding Q8_0): no larger than the Q4_1 GGUF it
    ships in, its tokenizer is the shipped one, and transformers runs it with the in-torch model's logits."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf
    from llmcompress.io.load import ALIASES, alias_gguf_path

    model = copy.deepcopy(smollm2.model)
    qweights, _ = quantize_for_export(model, smollm2.tokenizer, "gguf", ExportOptions(bits=4, group_size=32, sym=True), progress=False)
    res = write_gguf(model, tmp_path / "q4.gguf", qweights=qweights, float_dtype="bfloat16", tokenizer=smollm2.tokenizer)
    assert res["tokenizer"].startswith("copied from") and res["tensor_types"] == {"Q8_0": 1, "Q4_0": 210, "F32": 61}
    assert res["bytes"] <= alias_gguf_path(ALIASES["smollm2-135m"]).stat().st_size
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="q4.gguf")
    text = "The quick brown fox jumps over the lazy dog, 1234."
    assert tok.encode(text) == smollm2.tokenizer.encode(text)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q4.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([smollm2.tokenizer.encode(text)])
    with torch.no_grad():
        ref, got = model(ids).logits, loaded(ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()) <= 1e-5
