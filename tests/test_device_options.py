"""--device / --dtype on every command that computes (issue 20): one shared option and one resolver; a GPU
asked for on a machine without one, or an unknown name, is one line `error: ...`, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

BASE = {
    "eval": ["/no/such/model", "--no-speed"],
    "collapse": ["/no/such/model", "--pareto"],
    "distill": ["/no/such/model", "--keep-layers", "2"],
    "nas": ["/no/such/model", "--target-bits", "4"],
    "export": ["/no/such/model", "--to", "gguf"],
}


def run_cli(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


def test_every_computing_command_takes_the_shared_device_and_dtype_options():
    import typing

    from llmcompress.cli import _options, app

    for info in app.registered_commands:
        if info.name not in BASE:
            continue
        hints = typing.get_type_hints(info.callback, include_extras=True)
        assert hints.get("device") == _options.DeviceOpt and hints.get("dtype") == _options.DtypeOpt, info.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("cmd", sorted(BASE))
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_one_line_exit_2_nothing_written(cmd, device, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, lines = run_cli(capsys, cmd, *BASE[cmd], "--device", device, "--out", out)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --device {device} asked for but no CUDA device is available") and "--device cpu" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("cmd", sorted(BASE))
@pytest.mark.parametrize("flag,value,needle", [("--device", "tpu", "unknown device 'tpu'"), ("--dtype", "int8", "unknown dtype 'int8'")])
def test_unknown_device_or_dtype_is_one_line_exit_2(cmd, flag, value, needle, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, lines = run_cli(capsys, cmd, *BASE[cmd], flag, value, "--out", out)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_distill_refuses_a_half_precision_student(dtype, tmp_path, capsys):
    code, _, lines = run_cli(capsys, "distill", *BASE["distill"], "--device", "cpu", "--dtype", dtype, "--out", tmp_path / "o")
    assert code == 2 and len(lines) == 1 and "float32" in lines[0] and "--precision bf16" in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_auto_dtype_is_the_source_dtype_on_gpu_and_float32_on_cpu():
    from llmcompress.runtime import resolve_dtype

    assert resolve_dtype("auto", "cpu", "bfloat16") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:0", "float16") is torch.float16
    assert resolve_dtype("auto", "cuda", None) is torch.float32  # source unknown: float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16 and resolve_dtype("float32", "cuda") is torch.float32


def test_auto_dtype_reads_the_source_dtype_of_a_checkpoint(tiny_hf_dir, monkeypatch):
    """On a GPU, auto takes the checkpoint's own dtype (config.json), not float32 (no GPU needed: the
    device check is replaced, the dtype rule is what is tested)."""
    from llmcompress import runtime

    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (tiny_hf_dir / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(runtime, "resolve_device", lambda name: (torch.device("cuda"), "test"))
    assert runtime.resolve_compute("cuda", "auto", str(tiny_hf_dir)) == (torch.device("cuda"), torch.bfloat16)
    monkeypatch.undo()
    assert runtime.resolve_compute("cpu", "auto", str(tiny_hf_dir)) == (torch.device("cpu"), torch.float32)


def test_eval_dtype_reaches_the_model(tiny_hf_dir, tmp_path, capsys):
    """--dtype bfloat16 on the CPU computes in bf16: the perplexity is the bf16 model's, not float32's."""
    from llmcompress.eval.perplexity import perplexity
    from llmcompress.io.load import load_model

    text = tmp_path / "t.txt"
    text.write_text("a small text for a small model, repeated. " * 40)
    args = ["eval", str(tiny_hf_dir), "--ppl", str(text), "--seq-len", "64", "--no-speed", "--json", "--device", "cpu"]
    got = {}
    for dtype in ("bfloat16", "auto"):
        code, out, lines = run_cli(capsys, *args, "--dtype", dtype)
        assert code == 0, lines
        got[dtype] = json.loads(out)["models"][0][f"ppl/{text}"]
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("auto", torch.float32)):
        lm = load_model(str(tiny_hf_dir), dtype=torch_dtype)
        assert got[dtype] == perplexity(lm.model, lm.tokenizer, str(text), seq_len=64)["ppl"]
    assert got["bfloat16"] != got["auto"]
