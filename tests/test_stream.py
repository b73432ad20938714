"""Layer streaming (io/stream.py): a model read one decoder layer at a time from its safetensors files gives
the same logits, perplexity, Block Influence and GPTQ integers as the model in memory, and holds only a
few layers in memory (measured in a subprocess)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model

FAMILIES = ["llama", "qwen2", "gpt2"]


def _blocks(n=5, t=32, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def saved(tmp_path):
    def make(family="llama", layers=4, dtype=None):
        model = tiny_model(family, layers=layers)
        path = tmp_path / f"{family}-{layers}"
        (copy.deepcopy(model).to(dtype) if dtype else model).save_pretrained(path)
        return model, path

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_logits_and_nll_equal_in_memory(family, saved):
    from llmcompress.eval.perplexity import nll_of_blocks
    from llmcompress.io.stream import LayerRunner, boundary_walk, streamed_nll

    model, path = saved(family)
    blocks = _blocks()
    runner = LayerRunner.open(path, batch=2)
    assert all(p.device.type == "meta" for p in runner.adapter.decoder_layers(runner.model).parameters())
    last = boundary_walk(runner, blocks)
    logits = torch.cat([runner.logits(h) for h in last])
    with torch.no_grad():
        ref = model(input_ids=blocks, use_cache=False).logits
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    # every layer is back on the meta device after the walk: nothing of the decoder stays loaded
    assert all(p.device.type == "meta" for p in runner.adapter.decoder_layers(runner.model).parameters())
    nll, n = streamed_nll(runner, blocks)
    ref_nll, ref_n = nll_of_blocks(model, blocks, batch_size=2)
    assert n == ref_n == blocks.shape[0] * (blocks.shape[1] - 1)
    assert nll == pytest.approx(ref_nll, rel=1e-6)


def test_streamed_bf16_checkpoint_computes_in_float32(saved):
    """A bf16 checkpoint streamed in float32 equals the same checkpoint loaded whole in float32."""
    from llmcompress.io.load import load_model
    from llmcompress.io.stream import LayerRunner, boundary_walk

    _, path = saved("llama", dtype=torch.bfloat16)
    ref_model = load_model(str(path), dtype=torch.float32).model
    blocks = _blocks(3)
    runner = LayerRunner.open(path, dtype=torch.float32, batch=3)
    # the embedding (tied to the head) stays bf16: half the bytes of the largest resident tensor
    assert runner.adapter.embeddings(runner.model).weight.dtype == torch.bfloat16
    assert runner.adapter.head(runner.model).weight.dtype == torch.bfloat16
    big = {runner.adapter.embed + ".weight", runner.adapter.lm_head + ".weight"}
    assert all(p.dtype == torch.float32 for n, p in runner.model.named_parameters() if n not in big and p.device.type != "meta")
    logits = runner.logits(boundary_walk(runner, blocks)[0])
    assert logits.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(logits, ref_model(input_ids=blocks, use_cache=False).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_streamed_block_influence_equals_in_memory(family, saved):
    from llmcompress.collapse.fitness import block_influence
    from llmcompress.io.forward import boundary_states
    from llmcompress.io.stream import LayerRunner, block_influence_layerwise

    model, path = saved(family, layers=6)
    blocks = _blocks(4)
    states, _ = boundary_states(model, blocks)
    ref = block_influence(states)
    streamed = block_influence_layerwise(LayerRunner.open(path, batch=2), blocks)
    in_memory = block_influence_layerwise(LayerRunner(model, batch=2), blocks)
    assert streamed == pytest.approx(ref, abs=1e-6) and in_memory == pytest.approx(ref, abs=1e-6)
    assert sorted(range(6), key=lambda i: streamed[i]) == sorted(range(6), key=lambda i: ref[i])  # same layers dropped


def _plan(bits=4, group=16):
    from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

    plan = MixedPrecisionPlan()
    plan[r"re:.*\.layers\.\d+\..*"] = QuantConfig(bits=bits, group_size=group, method="gptq")
    plan["_default"] = None
    return plan


@pytest.mark.parametrize("family,act_order", [("llama", True), ("qwen2", False)])
def test_gptq_layer_by_layer_keeps_the_integers_and_streams_them_identically(family, act_order, saved):
    from llmcompress.io.stream import LayerRunner
    from llmcompress.quant.apply import linear_fqns
    from llmcompress.quant.gptq import gptq_layerwise_, gptq_model_, gptq_quantize, input_hessians

    model, path = saved(family)
    blocks, plan = _blocks(), _plan()
    targets = plan.quantized(linear_fqns(model))
    assert len(targets) == 28
    # the reference: every Hessian at once from one pass of the unquantized model (the former gptq_model_)
    H = input_hessians(model, list(targets), blocks)
    mods = dict(model.named_modules())
    old = {f: gptq_quantize(mods[f].weight.data, H[f], 4, 16, act_order=act_order) for f in targets}
    new_model = copy.deepcopy(model)
    new = gptq_model_(new_model, plan, blocks, progress=False, act_order=act_order)
    assert set(new) == set(targets)
    for f in targets:
        assert torch.equal(new[f].q, old[f][0]) and torch.equal(new[f].scale, old[f][1]) and torch.equal(new[f].zero, old[f][2]), f
        torch.testing.assert_close(dict(new_model.named_modules())[f].weight, new[f].dequantize(torch.float32), rtol=0, atol=0)
    got: dict = {}
    layers_seen = []

    def sink(i, qweights):
        layers_seen.append(i)
        got.update(qweights)

    streamed = gptq_layerwise_(LayerRunner.open(path, batch=2), plan, blocks, act_order=act_order, sink=sink, progress=False)
    assert streamed == {} and layers_seen == [0, 1, 2, 3]
    for f in targets:
        assert torch.equal(got[f].q, new[f].q) and torch.equal(got[f].scale, new[f].scale) and torch.equal(got[f].zero, new[f].zero), f


def test_sequential_gptq_inputs_from_quantized_layers(saved):
    """inputs="quantized": layer i's Hessians come from the already quantized layers 0..i-1, so layer 0 is
    unchanged and later layers differ from the dense-input integers; streamed equals in memory."""
    from llmcompress.io.stream import LayerRunner
    from llmcompress.quant.gptq import gptq_layerwise_, gptq_model_

    model, path = saved("llama")
    blocks, plan = _blocks(), _plan(bits=3)
    dense = gptq_model_(copy.deepcopy(model), plan, blocks, progress=False)
    seq = gptq_model_(copy.deepcopy(model), plan, blocks, progress=False, inputs="quantized")
    streamed = gptq_layerwise_(LayerRunner.open(path, batch=2), plan, blocks, inputs="quantized", progress=False)
    assert all(torch.equal(seq[f].q, dense[f].q) for f in seq if ".layers.0." in f)
    assert any(not torch.equal(seq[f].q, dense[f].q) for f in seq if ".layers.3." in f)
    assert all(torch.equal(streamed[f].q, seq[f].q) for f in seq)


def test_eval_streams_above_max_memory_with_the_in_memory_perplexity(tiny_hf_dir, tmp_path, capsys):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    args = ["eval", str(tiny_hf_dir), "--ppl", str(text), "--seq-len", "64", "--max-tokens", "1024", "--no-speed", "--json",
            "--device", "cpu"]

    def run(*extra):
        capsys.readouterr()
        code = run_app(app, args + list(extra))
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)["models"][0], err

    ref, err_ref = run()
    streamed, err = run("--max-memory", "0")
    big, err_big = run("--max-memory", "64GiB")
    key = f"ppl/{text}"
    assert "streaming its layers from disk" in err and "streaming" not in err_ref and "streaming" not in err_big
    assert streamed.get("streamed") is True and not big.get("streamed")
    assert streamed[key] == pytest.approx(ref[key], rel=1e-6) and big[key] == ref[key]
    assert streamed[f"{key}/tokens_scored"] == ref[f"{key}/tokens_scored"]


def test_bad_max_memory_is_one_line_exit_2(tiny_hf_dir, tmp_path, capsys):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    out = tmp_path / "out"
    for bad in ("banana", "-1", "12XB"):
        capsys.readouterr()
        code = run_app(app, ["eval", str(tiny_hf_dir), "--no-speed", "--max-memory", bad, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --max-memory") and "e.g. 8GiB" in err[0], err
        assert not out.exists()


_PROBE = textwrap.dedent("""
    import json, sys, torch
    from llmcompress.io.stream import LayerRunner, streamed_nll
    from llmcompress.eval.perplexity import nll_of_blocks
    # imported before the baseline (model code, accelerate, the loader: ~130 MiB), so only data is measured
    import accelerate.utils, transformers.models.llama.modeling_llama, llmcompress.io.load

    def status(key):  # kB; VmHWM is this process's peak RSS (ru_maxrss would carry the parent's over exec)
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key + ":")) * 1024

    torch.set_num_threads(1)
    blocks = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    mode, path = sys.argv[1], sys.argv[2]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    base = status("VmRSS")
    if mode == "stream":
        nll, n = streamed_nll(LayerRunner.open(path, batch=2), blocks)
    else:
        from llmcompress.io.load import load_model
        nll, n = nll_of_blocks(load_model(path).model, blocks, batch_size=2)
    print(json.dumps({"delta": status("VmHWM") - base, "nll": nll}))
""")


_GPTQ_PROBE = textwrap.dedent("""
    import hashlib, json, sys, torch
    from llmcompress.io.stream import LayerRunner
    from llmcompress.quant.gptq import gptq_layerwise_, gptq_model_
    from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig
    import accelerate.utils, transformers.models.llama.modeling_llama, llmcompress.io.load

    def status(key):
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key + ":")) * 1024

    torch.set_num_threads(1)
    blocks = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = MixedPrecisionPlan()
    plan[r"re:.*\\.layers\\.\\d+\\..*"] = QuantConfig(bits=4, group_size=128, method="gptq")
    plan["_default"] = None
    digest = hashlib.sha256()

    def sink(i, qweights):  # the integers leave layer by layer, as the streamed export writes them
        for fqn in sorted(qweights):
            for t in (qweights[fqn].q, qweights[fqn].scale, qweights[fqn].zero):
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())

    mode, path = sys.argv[1], sys.argv[2]
    # runtime before the baseline: the modules imported inside, LAPACK's and BLAS's first-call buffers
    import llmcompress.quant.apply, llmcompress.progress
    torch.cholesky_inverse(torch.linalg.cholesky(torch.eye(300))) @ torch.eye(300)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    if mode == "stream":
        gptq_layerwise_(LayerRunner.open(path, batch=2), plan, blocks, act_order=True, sink=sink, progress=False)
    else:
        from llmcompress.io.load import load_model
        gptq_model_(load_model(path).model, plan, blocks, act_order=True, sink=sink, progress=False)
    print(json.dumps({"delta": status("VmHWM") - base, "ints": digest.hexdigest()}))
""")


@pytest.fixture
def wide(tiny_hf_dir, tmp_path):
    """A 12-layer LLaMA of 10.5 MiB layers (fp32, 126 MiB of decoder weights) built from config; returns
    (path, checkpoint bytes, one layer's bytes, probe(code, mode) -> the probe's JSON, run in a subprocess)."""
    import transformers

    from llmcompress.io.stream import checkpoint_bytes_at

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                   num_key_value_heads=8, num_hidden_layers=12, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path / "wide"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_hf_dir / f).is_file():
            (path / f).write_bytes((tiny_hf_dir / f).read_bytes())
    layer = (4 * 512 * 512 + 3 * 512 * 1024 + 2 * 512) * 4
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def probe(code, mode):
        proc = subprocess.run([sys.executable, "-c", code, mode, str(path)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return path, checkpoint_bytes_at(path, torch.float32), layer, probe


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS read from Linux /proc")
def test_streamed_peak_memory_is_a_few_layers(wide):
    """Perplexity in memory grows the process by at least the whole model; streamed by at most a few layers
    (6: one layer, its reading buffers and allocator slack, which varies with the machine's load). Each arm in
    its own process."""
    path, total, layer, probe = wide
    mem, streamed = probe(_PROBE, "memory"), probe(_PROBE, "stream")
    assert streamed["nll"] == pytest.approx(mem["nll"], rel=1e-6)
    assert mem["delta"] > 0.9 * total  # the in-memory arm holds every layer
    assert streamed["delta"] < min(6 * layer, 0.5 * total), (streamed["delta"] / layer, total / layer)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS read from Linux /proc")
def test_streamed_gptq_peak_memory_is_a_few_layers(wide):
    """GPTQ layer by layer, streamed: one layer, its Hessians, the quantizer's working copies (the weight,
    the Hessian's Cholesky factors, the integers) and heap slack, about 5 layers here (measured 5.1-5.3 on
    an idle machine), whatever the depth; in memory at least the whole model. The bound has slack for a
    loaded machine. The integers are the same (digest of every layer's q, scale, zero)."""
    path, total, layer, probe = wide
    mem, streamed = probe(_GPTQ_PROBE, "memory"), probe(_GPTQ_PROBE, "stream")
    assert streamed["ints"] == mem["ints"]
    assert mem["delta"] > 0.9 * total
    assert streamed["delta"] < min(8 * layer, 0.75 * total), (streamed["delta"] / layer, total / layer)


def test_streamed_runner_sets_and_restores_the_mmap_threshold(saved, monkeypatch):
    """While a streamed runner lives, glibc's mmap threshold is 4 MiB (big tensors are unmapped when freed);
    closing the last runner (or its collection) sets glibc's maximum back; in-memory runners leave it alone."""
    import gc

    from llmcompress.io import stream

    if stream._mallopt() is None:
        pytest.skip("not glibc")
    gc.collect()  # runners of earlier tests
    assert stream._LIVE_RUNNERS == 0
    calls = []
    monkeypatch.setattr(stream, "_MALLOPT", lambda opt, value: calls.append((opt, value)) or 1)
    _, path = saved("llama", layers=2)
    a = stream.LayerRunner.open(path)
    b = stream.LayerRunner.open(path)
    assert calls == [(stream._M_MMAP_THRESHOLD, 4 * 2**20)]
    a.close()
    a.close()  # once only
    assert len(calls) == 1
    del b
    gc.collect()
    assert calls == [(stream._M_MMAP_THRESHOLD, 4 * 2**20), (stream._M_MMAP_THRESHOLD, 32 * 2**20)]
    stream.LayerRunner(tiny_model("llama", layers=2))
    assert len(calls) == 2 and stream._LIVE_RUNNERS == 0


def _read_all(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_streamed_gptq_export_with_nothing_to_quantize_writes_floats(tiny_hf_dir, tmp_path, capsys):
    """--quant gptq --bits 16 streamed: nothing is quantized, so there are no calibration blocks, and the streamed
    writer must not start GPTQ without them (it crashed in the embedding of None); same floats as in memory."""
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    common = ["export", str(tiny_hf_dir), "--to", "compressed-tensors", "--quant", "gptq", "--bits", "16", "--device", "cpu"]
    for arm, extra in (("memory", []), ("stream", ["--max-memory", "0"])):
        capsys.readouterr()
        assert run_app(app, common + ["--out", str(tmp_path / arm)] + extra) == 0, capsys.readouterr().err
    a, b = _read_all(tmp_path / "memory"), _read_all(tmp_path / "stream")
    assert sorted(a) == sorted(b) and not any(k.endswith("weight_packed") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("quant", ["gptq", "rtn"])
def test_streamed_compressed_tensors_export_equals_in_memory(quant, tiny_hf_dir, tmp_path, capsys):
    """export --to compressed-tensors above --max-memory: written layer by layer, one shard each, with the
    same tensors and quantization config as the in-memory export."""
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    text = tmp_path / "calib.txt"
    text.write_text("calibration text for a tiny model, with some variety: 0123456789 abcdefghij. " * 80)
    common = ["export", str(tiny_hf_dir), "--to", "compressed-tensors", "--quant", quant, "--bits", "4", "--group-size", "32",
              "--calib-data", str(text), "--device", "cpu", "--json"]
    outs = {}
    for arm, extra in (("memory", []), ("stream", ["--max-memory", "0"])):
        capsys.readouterr()
        code = run_app(app, common + ["--out", str(tmp_path / arm)] + extra)
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[arm] = (json.loads(out), err)
    assert "streaming its layers" in outs["stream"][1] and "streaming" not in outs["memory"][1]
    assert outs["stream"][0]["streamed"] is True and len(list((tmp_path / "stream").glob("*.safetensors"))) == 5
    a, b = _read_all(tmp_path / "memory"), _read_all(tmp_path / "stream")
    assert sorted(a) == sorted(b) and any(k.endswith("weight_packed") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg_a = json.loads((tmp_path / "memory" / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert cfg_a["quantization_config"] == cfg_b["quantization_config"]
    assert outs["memory"][0]["parameters"] == outs["stream"][0]["parameters"]
    index = json.loads((tmp_path / "stream" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(b)


def test_widened_head_matches_the_float32_head_and_keeps_no_widened_copy_for_backward():
    """A bf16 resident head applied to float32 states (streamed distill's logit KL): the same logits and input
    gradient as the head widened once, while autograd keeps only the bf16 weight (no float32 slices)."""
    from llmcompress.io.stream import widened_linear

    torch.manual_seed(0)
    W, b = torch.randn(5000, 64).bfloat16(), torch.randn(5000).bfloat16()
    x = torch.randn(2, 3, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        y = widened_linear(x, W, b, rows=1024)
    g = torch.randn_like(y)
    y.backward(g)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, W.float(), b.float())
    y2.backward(g)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-3)  # summation order
    assert sum(saved) <= W.numel() * W.element_size()  # the bf16 weight itself, not 4 bytes per entry
