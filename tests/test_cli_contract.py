"""CLI -> engine contract: each engine command builds the config it should and hands it to its engine.

In the style of huggingface_hub's CLI tests: the engine entry point is replaced by a recorder, the Typer app
runs in-process (typer.testing.CliRunner), and the test asserts the config object and keyword arguments the
CLI forwarded, so the CLI layer is tested without running an engine. Options not given must leave the
config's (or the --spec file's) values alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from llmcompress.cli import app


@pytest.fixture
def engine(monkeypatch):
    """Replace an engine entry point (module path, attribute) by a recorder of its arguments."""
    calls = []

    def install(module: str, name: str, result):
        import importlib

        def fake(cfg, out, **kwargs):
            calls.append(SimpleNamespace(cfg=cfg, out=Path(out), kwargs=kwargs))
            return result(Path(out))

        monkeypatch.setattr(importlib.import_module(module), name, fake)
        return calls

    return install


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def changed(cfg, default) -> dict:
    """The fields of `cfg` that differ from `default` (both dataclasses of one type)."""
    a, b = dataclasses.asdict(cfg), dataclasses.asdict(default)
    return {k: v for k, v in a.items() if v != b[k]}


def _collapse(engine):
    return engine("llmcompress.collapse.pipeline", "run_collapse", lambda out: SimpleNamespace(out_dir=out, front=[], saved=[]))


def _nas(engine):
    arch = {"avg_bits": 4.0, "modeled_latency": 0.5, "size_mb": 1.0}
    return engine("llmcompress.nas.pipeline", "run_nas", lambda out: SimpleNamespace(out_dir=out, arch=arch))


def _distill(engine):
    metrics = {"student_layers": 2, "student_parameters": 10, "train_wall_s": 1.0, "peak_rss_mb": 1.0}
    return engine("llmcompress.distill.engine", "distill", lambda out: SimpleNamespace(student_dir=out / "student", metrics=metrics))


def test_collapse_forwards_its_options(engine, tiny_hf_dir, tmp_path):
    from llmcompress.collapse.config import CollapseConfig

    calls = _collapse(engine)
    invoke("collapse", tiny_hf_dir, "--target-layers", 3, "--method", "shortgpt", "--seed", 5, "--calib-data", "notes.txt",
           "--eval-tokens", 0, "--max-cache-gb", 0.5, "--out", tmp_path / "o", "--overwrite", "--device", "cpu",
           "--max-memory", "500MB")
    (call,) = calls
    assert changed(call.cfg, CollapseConfig()) == {
        "model": str(tiny_hf_dir), "method": "shortgpt", "pareto": False, "target_layers": 3, "seed": 5,
        "calib_source": "notes.txt", "eval_tokens": 0, "max_cache_gb": 0.5,
    }
    assert type(call.cfg.method) is str  # the config holds the value, not the CLI's Enum member
    assert call.out == tmp_path / "o" and call.kwargs == {"overwrite": True, "resume": False, "device": "cpu", "dtype": torch.float32,
                                                        "max_memory": 500 * 10**6}


def test_collapse_spec_supplies_what_the_command_line_does_not_give(engine, tiny_hf_dir, tmp_path):
    from llmcompress.collapse.config import CollapseConfig

    calls = _collapse(engine)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {tiny_hf_dir}\npopulation: 6\nseed: 1\npareto: true\n")
    invoke("collapse", "--spec", spec, "--seed", 2, "--out", tmp_path / "o")
    assert changed(calls[0].cfg, CollapseConfig()) == {"model": str(tiny_hf_dir), "population": 6, "seed": 2}  # the flag wins


def test_nas_forwards_its_options(engine, tiny_hf_dir, tmp_path):
    from llmcompress.nas.config import NasConfig

    calls = _nas(engine)
    invoke("nas", tiny_hf_dir, "--target-bits", 4, "--cost-model", "lut", "--quant", "rtn", "--mode", "sequential",
           "--bits", "4,8", "--head-bits", "8,16", "--baselines", "", "--export", "gguf", "--train-tokens", 2048, "--out", tmp_path / "o", "--resume", "--device", "cpu")
    (call,) = calls
    assert changed(call.cfg, NasConfig()) == {
        "model": str(tiny_hf_dir), "target_bits": 4.0, "cost_model": "lut", "quant_method": "rtn", "mode": "sequential",
        "bits": [4, 8], "head_bits": [8, 16], "baselines": [], "export": ["gguf"], "train_tokens": 2048,
    }
    assert {type(call.cfg.cost_model), type(call.cfg.quant_method), type(call.cfg.mode)} == {str}
    assert call.kwargs == {"overwrite": False, "resume": True, "device": "cpu", "dtype": torch.float32}


def test_nas_spec_and_flags_combine(engine, tiny_hf_dir, tmp_path):
    from llmcompress.nas.config import NasConfig

    calls = _nas(engine)
    spec = tmp_path / "s.yaml"
    spec.write_text("cost_model: lut\ntarget_latency: 0.7\nseq_len: 32\n")
    invoke("nas", tiny_hf_dir, "--spec", spec, "--quant", "rtn", "--out", tmp_path / "o")
    assert changed(calls[0].cfg, NasConfig()) == {"model": str(tiny_hf_dir), "cost_model": "lut", "target_latency": 0.7,
                                                  "seq_len": 32, "quant_method": "rtn"}


def test_distill_forwards_its_options(engine, tiny_hf_dir, tmp_path):
    from llmcompress.distill.config import CacheDtype, DistillConfig, Mode, Select

    calls = _distill(engine)
    invoke("distill", tiny_hf_dir, "--keep-layers", 2, "--select", "bi", "--mode", "e2e", "--cache-dtype", "fp16",
           "--seq-len", 32, "--kl-weight", 0.5, "--cache-dir", tmp_path / "cache", "--out", tmp_path / "o", "--device", "cpu",
           "--keep-work")
    (call,) = calls
    assert changed(call.cfg, DistillConfig()) == {
        "teacher": str(tiny_hf_dir), "keep_layers": 2, "select": Select.BI, "mode": Mode.E2E, "cache_dtype": CacheDtype.FP16,
        "seq_len": 32, "kl_weight": 0.5, "cache_dir": str(tmp_path / "cache"),
    }
    kw = call.kwargs
    assert kw["device"] == "cpu" and kw["keep_work"] and not kw["overwrite"] and not kw["resume"] and kw["dist"].world_size == 1


def test_distill_takes_a_spec_and_flags_override_it(engine, tiny_hf_dir, tmp_path):
    from llmcompress.distill.config import DistillConfig, HiddenLoss

    calls = _distill(engine)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"teacher: {tiny_hf_dir}\nkeep_layers: 2\ntrain_tokens: 512\nhidden_loss: cosine\nmix_end: 0.5\n")
    invoke("distill", "--spec", spec, "--train-tokens", 1024, "--out", tmp_path / "o")
    assert changed(calls[0].cfg, DistillConfig()) == {"teacher": str(tiny_hf_dir), "keep_layers": 2, "train_tokens": 1024,
                                                      "hidden_loss": HiddenLoss.COSINE, "mix_end": 0.5}


@pytest.mark.parametrize("text,needle", [("keep_layer: 2\n", "unknown search-spec key(s): keep_layer"),
                                         ("mode: fast\n", "unknown mode 'fast'"),
                                         ("kl_temperature: 0\n", "kl_temperature must be > 0")])
def test_distill_spec_errors_are_one_line_and_nothing_runs(engine, tiny_hf_dir, tmp_path, capsys, text, needle):
    from llmcompress.cli._errors import run_app

    calls = _distill(engine)
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    capsys.readouterr()
    code = run_app(app, ["distill", str(tiny_hf_dir), "--spec", str(spec), "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert calls == [] and not (tmp_path / "o").exists()
