"""`eval --runtime llama.cpp`: the missing-extra error, input checks, the perplexity protocol, and (with the
extra installed) llama.cpp's perplexity against torch's on the same GGUF weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_cli import ENV, assert_user_error, run


def run_without_llama_cpp(*args, cwd=None):
    """The CLI in a process where `import llama_cpp` fails, whether or not the extra is installed here."""
    code = "import sys; sys.modules['llama_cpp'] = None; from llmcompress.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def test_missing_extra_exits_2_with_the_install_command(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never opened: the runtime check comes before any model is read
    out = tmp_path / "report"
    proc = run_without_llama_cpp("eval", str(gguf), "--runtime", "llama.cpp", "--out", str(out), cwd=tmp_path)
    assert_user_error(proc, "llama-cpp-python", "pip install -e .[runtime]")
    assert not out.exists()


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["eval", "{tiny}", "--runtime", "llama.cpp"], ["runs .gguf files", "llmcompress export"]),
        (["eval", "{gguf}", "--runtime", "onnx"], ["unknown runtime", "llama.cpp"]),
        (["eval", "{gguf}", "--runtime", "llama.cpp", "--threads", "-1"], ["--threads -1"]),
    ],
)
def test_runtime_bad_input_exits_2(args, fragments, tiny_hf_dir, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
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
