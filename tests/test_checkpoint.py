"""Checkpoints: atomic save, manifest, reload with plain transformers, corrupt files detected."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from llmcompress.errors import UserError
from llmcompress.io.checkpoint import build_manifest, save_checkpoint
from llmcompress.io.load import load_model, resolve
from llmcompress.io.surgery import remove_layers

IDS = torch.arange(3, 40).view(1, -1)


def _manifest():
    return build_manifest(source="tiny", source_hash="abc", method="test", config={"drop": [1]}, metrics={"ppl": 1.0})


def test_save_reload_plain_transformers_identical(tmp_path, family):
    from transformers import AutoModelForCausalLM

    model = tiny_model(family, layers=3)
    remove_layers(model, [1])
    out = save_checkpoint(model, None, tmp_path / "ckpt", manifest=_manifest())
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)
    manifest = json.loads((out / "llmcompress.json").read_text())
    assert manifest["method"] == "test" and manifest["layers"] == 2
    assert manifest["source_model"]["weights_sha256"] == "abc"
    assert len(manifest["weights_sha256"]) == 64


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, None, tmp_path / "ckpt", manifest=_manifest())
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(tmp_path):
    model = tiny_model("llama", layers=2)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("precious")
    with pytest.raises(UserError, match="already exists"):
        save_checkpoint(model, None, tmp_path / "ckpt", manifest=_manifest())
    assert (tmp_path / "ckpt" / "keep.txt").read_text() == "precious"


def test_load_roundtrip_through_llmcompress(tiny_hf_dir):
    lm = load_model(str(tiny_hf_dir))
    assert lm.adapter.family == "llama" and lm.tokenizer is not None
    assert lm.model.config.num_hidden_layers == 4


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors_is_a_user_error(tiny_hf_dir, damage):
    f = tiny_hf_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(UserError, match="corrupt checkpoint"):
        resolve(str(tiny_hf_dir))


def test_not_a_model_and_unsupported_architecture(tmp_path, tiny_hf_dir):
    with pytest.raises(UserError, match="not a model directory"):
        resolve(str(tmp_path))
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    cfg["model_type"] = "bert"
    (tiny_hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unsupported architecture 'bert'.*supported model types: llama"):
        try:
            resolve(str(tiny_hf_dir))
        except UserError as e:
            raise UserError(e.one_line()) from None
