"""Zipped checkpoints: byte-identical unzip, model loading, and corruption detected with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmcompress.errors import UserError
from llmcompress.lossless import container

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmcompress", *map(str, args)], capture_output=True, text=True, env=ENV)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
    )  # fmt: skip
    d = tmp_path_factory.mktemp("ck") / "tiny"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    (d / "llmcompress.json").write_text(json.dumps({"note": "kept"}))
    (d / "tokenizer.json").write_text("{}")
    # a second shard-like file holding fp32, fp16, int and odd-sized tensors plus special values
    from safetensors.torch import save_file

    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.0])
    save_file(
        {
            "extra.f32": torch.cat([torch.randn(10_001) * 0.02, special]),
            "extra.f16": (torch.randn(3, 333) * 0.1).half(),
            "extra.i64": torch.arange(7),
            "extra.empty": torch.zeros(0, 4),
        },
        str(d / "extra.safetensors"),
    )
    return d


@pytest.fixture(scope="module")
def zipped(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("z") / "zipped"
    stats = container.zip_checkpoint(ckpt, out, threads=2, chunk_kb=16)
    assert stats["ratio"] < 0.75 and "bfloat16" in stats["by_dtype"]
    return out


def test_zip_layout_and_byte_identical_unzip(ckpt, zipped, tmp_path):
    names = sorted(p.name for p in zipped.iterdir())
    assert "llmz.json" in names and "config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith(".safetensors") for n in names)
    assert (zipped / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    out = tmp_path / "restored"
    container.unzip_checkpoint(zipped, out, threads=2)
    for p in ckpt.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_load_zipped_model_matches_the_checkpoint(ckpt, zipped):
    from safetensors.torch import load_file

    sd = container.load_state_dict(zipped)
    for f in ("model.safetensors", "extra.safetensors"):
        for k, v in load_file(str(ckpt / f)).items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    model, _tok = container.load_zipped_model(zipped, dtype=torch.bfloat16)
    ref = load_file(str(ckpt / "model.safetensors"))
    got = model.state_dict()
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (1, 5))).logits.float()).all()


def test_load_model_detects_zipped_dirs(zipped):
    from llmcompress.io.load import load_model

    lm = load_model(str(zipped), dtype=torch.float32)
    assert next(lm.model.parameters()).dtype == torch.float32


def test_cli_zip_json_and_unzip(ckpt, tmp_path):
    r = _cli("zip", ckpt, "--out", tmp_path / "z", "--json", "--threads", "1", "--chunk-kb", "256")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert 0 < stats["by_dtype"]["bfloat16"]["ratio"] < 0.75 and stats["codec_MBps"] > 0
    r = _cli("zip", ckpt, "--out", tmp_path / "z")  # exists, no --overwrite
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    container.unzip_checkpoint(tmp_path / "z", tmp_path / "u")
    assert (tmp_path / "u" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_is_detected_with_exit_code_2(zipped, tmp_path, damage):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(zipped, bad)
    f = bad / "model.safetensors.llmz"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) - 1000] ^= 0x10
    else:
        data = data[: len(data) * 2 // 3]
    f.write_bytes(bytes(data))
    if damage == "flip":  # through the CLI: one line on stderr, exit code 2
        r = _cli("unzip", bad, "--out", tmp_path / "out")
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "corrupt" in lines[0]
    else:
        with pytest.raises(UserError, match="corrupt"):
            container.unzip_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(UserError):
        container.load_state_dict(bad)


def test_bad_inputs_raise_user_error(ckpt, tmp_path):
    with pytest.raises(UserError):
        container.zip_checkpoint(tmp_path / "missing", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError):
        container.zip_checkpoint(tmp_path / "empty", tmp_path / "o")
    with pytest.raises(UserError):
        container.unzip_checkpoint(ckpt, tmp_path / "o")  # not zipped
    r = _cli("unzip", tmp_path / "missing", "--out", tmp_path / "o")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
