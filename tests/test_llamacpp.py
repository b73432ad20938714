"""`eval --runtime llama.cpp`: the missing-extra error, input checks, the perplexity protocol, and (with the
extra installed) llama.cpp's perplexity against torch's on the same GGUF weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from test_cli import ENV, assert_user_error, run
from test_export import _tiny, bpe_tokenizer  # noqa: F401  (bpe_tokenizer: a fixture used below)


def run_without_llama_cpp(*args, cwd=None):
    """The CLI in a process where `import llama_cpp` fails, whether or not the extra is installed here."""
    code = "import sys; sys.modules['llama_cpp'] = None; from llmcompress.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def test_missing_extra_exits_2_with_the_install_command(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")  # a valid header; never loaded: the runtime check comes first
    out = tmp_path / "report"
    proc = run_without_llama_cpp("eval", str(gguf), "--runtime", "llama.cpp", "--out", str(out), cwd=tmp_path)
    assert_user_error(proc, "llama-cpp-python", "pip install -e .[runtime]")
    assert not out.exists()


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["eval", "{tiny}", "--runtime", "llama.cpp"], ["runs .gguf files", "llmcompress export"]),
        (["eval", "{gguf}", "--runtime", "onnx"], ["unknown runtime", "llama.cpp"]),
        (["eval", "{gguf}", "--runtime", "llama.cpp", "--threads", "-1"], ["--threads must be >= 0", "got -1"]),
    ],
)
def test_runtime_bad_input_exits_2(args, fragments, tiny_hf_dir, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    proc = run(*[a.format(tiny=tiny_hf_dir, gguf=gguf) for a in args], cwd=tmp_path)
    assert_user_error(proc, *fragments)


class TorchAsLlama:
    """The part of llama_cpp.Llama that `nll_of_blocks_llamacpp` uses (reset, eval, scores), computed by a
    torch model, so the windowing and scoring can be checked against `eval.perplexity` without llama.cpp."""

    def __init__(self, model, n_ctx: int, vocab: int):
        import numpy as np

        self.model, self.n_tokens, self.ids = model, 0, []
        self.scores = np.zeros((n_ctx, vocab), dtype=np.float32)

    def reset(self):
        self.n_tokens, self.ids = 0, []

    def eval(self, tokens):
        import torch

        self.ids = self.ids[: self.n_tokens] + list(tokens)
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([self.ids])).logits[0]
        self.scores[self.n_tokens : len(self.ids)] = logits[self.n_tokens :].numpy()
        self.n_tokens = len(self.ids)


def test_llamacpp_perplexity_scores_the_same_windows_as_torch(tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompress.eval.llamacpp import llamacpp_perplexity
    from llmcompress.eval.perplexity import perplexity

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(2000)))
    kw = dict(seq_len=48, max_tokens=1000)
    ref = perplexity(model, tok, str(text), batch_size=3, **kw)
    got = llamacpp_perplexity(None, tok, str(text), llm=TorchAsLlama(model, 48, model.config.vocab_size), **kw)
    assert got["tokens_scored"] == ref["tokens_scored"] == (1000 // 48) * 47
    assert got["windows"] == ref["windows"] == 1000 // 48
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
    assert 1.5 < ref["ppl"] < 1e5  # a real, non-degenerate perplexity


def _llama_cpp_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _llama_cpp_importable(), reason="llama-cpp-python is not installed (pip install -e .[runtime])")
@pytest.mark.parametrize("bits,sym", [(4, True), (8, True)])
def test_llamacpp_perplexity_matches_torch_on_an_exported_gguf(tmp_path, bpe_tokenizer, bits, sym):  # noqa: F811
    """A tiny LLaMA quantized (Q4_0 / Q8_0) and exported to GGUF, evaluated by `eval --runtime llama.cpp`:
    llama.cpp's perplexity (its own logits, quantized-activation dot products) is within 1% of torch's on the
    dequantized weights of the same file (measured: well under 1%)."""
    import torch

    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf

    tok = bpe_tokenizer
    model = _tiny(len(tok), layers=2)
    with torch.no_grad():  # decisive logits (random init is near uniform), so the comparison has teeth
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    qweights, _ = quantize_for_export(model, tok, "gguf", ExportOptions(bits=bits, group_size=32, sym=sym), progress=False)
    gguf_path = tmp_path / "m.gguf"
    write_gguf(model, gguf_path, qweights=qweights, float_dtype="float32", tokenizer=tok)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. hello world, compression! " * 60)
    proc = run("eval", str(gguf_path), "--runtime", "llama.cpp", "--threads", "2", "--ppl", str(text), "--seq-len", "64",
               "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_row, cpp_row = json.loads(proc.stdout)["models"]
    key = f"ppl/{text}"
    assert torch_row["runtime"] == "torch" and cpp_row["runtime"] == "llama.cpp"
    assert cpp_row[f"{key}/tokens_scored"] == torch_row[f"{key}/tokens_scored"] > 0
    assert abs(math.log(torch_row[key] / len(tok))) > 0.2  # far from a uniform guess over the vocabulary
    print(f"ppl torch {torch_row[key]:.4f}  llama.cpp {cpp_row[key]:.4f}  ratio {cpp_row[key] / torch_row[key]:.5f}")
    assert cpp_row[key] == pytest.approx(torch_row[key], rel=0.01)
    assert cpp_row[f"{key}/vs_torch"] == pytest.approx(cpp_row[key] / torch_row[key])
    assert cpp_row["decode_tokens_per_s"] > 0 and cpp_row["prefill_tokens_per_s"] > 0
    assert cpp_row["disk_bytes"] == gguf_path.stat().st_size



@pytest.mark.parametrize("amx", [True, False])
def test_amx_build_is_named_once_before_the_first_load(amx, monkeypatch, capsys):
    """A natively built llama.cpp with AMX can die with SIGILL on quantized GGUFs (export/README.md, Known limits);
    the signal kills the process, so the rebuild hint must be on stderr before any file is loaded, and only once."""
    import types

    from llmcompress.eval import llamacpp as L

    info = b"CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = %d | REPACK = 1 |" % int(amx)
    loads = []
    fake = types.SimpleNamespace(llama_print_system_info=lambda: info, Llama=lambda **kw: loads.append(kw) or "llm")
    monkeypatch.setattr(L, "_warned_amx", False)
    monkeypatch.setattr(L, "require_llama_cpp", lambda: fake)
    assert L.open_gguf("a.gguf", n_ctx=8, threads=1) == "llm"
    assert L.open_gguf("b.gguf", n_ctx=8, threads=1) == "llm"
    err = capsys.readouterr().err
    assert len(loads) == 2
    if amx:
        assert err.count("AMX_INT8 = 1") == 1 and "-mno-amx-int8" in err
    else:
        assert err == ""
