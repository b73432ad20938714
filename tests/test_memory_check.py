"""Engines that hold the whole model (nas, distill's end-to-end mode) refuse in one line, before writing anything,
a model whose weights alone exceed the available memory (io.stream.check_fits), instead of being killed by the
kernel after loading; the streaming engines (collapse, eval, export, distill's layer-wise mode) stream it instead,
as tests/test_collapse_stream.py, tests/test_stream.py and tests/test_distill_stream.py check."""

from __future__ import annotations

import pytest

import llmcompress.io.stream as S


def _run(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, [str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["nas", "distill"])
def test_a_model_larger_than_memory_exits_2_in_one_line_and_writes_nothing(command, tiny_hf_dir, tmp_path, capsys, monkeypatch):
    need = S.checkpoint_bytes_at(tiny_hf_dir, __import__("torch").float32)
    monkeypatch.setattr(S, "available_memory", lambda device=None: need - 1)
    out = tmp_path / "out"
    args = {"nas": ["nas", tiny_hf_dir, "--target-bits", "4", "--out", out],
            "distill": ["distill", tiny_hf_dir, "--keep-layers", 2, "--mode", "e2e", "--seq-len", 64, "--out", out,
                        "--cache-dir", tmp_path / "cache"]}[command]
    code, err = _run(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert "more than the" in lines[0] and "holds the whole model" in lines[0] and "stream" in lines[0]
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_check_fits_passes_a_model_that_exactly_fits(tiny_hf_dir, monkeypatch):
    import torch

    need = S.checkpoint_bytes_at(tiny_hf_dir, torch.float32)
    monkeypatch.setattr(S, "available_memory", lambda device=None: need)
    S.check_fits(str(tiny_hf_dir), torch.float32, what="x")
    monkeypatch.setattr(S, "available_memory", lambda device=None: need - 1)
    with pytest.raises(S.UserError):
        S.check_fits(str(tiny_hf_dir), torch.float32, what="x")
