"""Every saved checkpoint carries a model card (README.md) that huggingface_hub reads back, and its recipe.yaml."""

from __future__ import annotations

import yaml
from huggingface_hub import ModelCard

from llmcompress.io.card import command_line
from llmcompress.io.checkpoint import build_manifest, save_checkpoint


def save(tiny_llama, out, **kw):
    return save_checkpoint(tiny_llama, None, out, manifest=build_manifest(source_hash="abc", **kw))


def test_card_of_a_collapsed_alias_model(tiny_llama, tmp_path):
    config = {"method": "gelaco", "population": 8, "alpha_grid": [0.0, 1.0]}
    out = save(tiny_llama, tmp_path / "gelaco-22L", source="smollm2-135m", method="collapse/gelaco", config=config,
               metrics={"kl_val": 0.1234, "ppl/wikitext2": 31.5})
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.base_model_relation == "finetune" and "pruned" in card.data.tags
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert "| kl_val | 0.1234 |" in card.text and "| ppl/wikitext2 | 31.5 |" in card.text
    assert "collapse/gelaco" in card.text and "Python API" in card.text  # made in-process: no command line
    assert yaml.safe_load((out / "recipe.yaml").read_text()) == config


def test_relation_and_lineage(tiny_llama, tmp_path):
    nas = save(tiny_llama, tmp_path / "nas", source="smollm2-135m", method="nas-joint", extra={"avg_bits": 4.0})
    assert ModelCard.load(nas / "README.md").data.base_model_relation == "quantized"
    student = save(tiny_llama, tmp_path / "student", source=str(nas), method="distill-layerwise")
    data = ModelCard.load(student / "README.md").data  # a local source: its own card's base model and license
    assert (data.base_model, data.base_model_relation, data.license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "finetune", "apache-2.0")
    hub = save(tiny_llama, tmp_path / "hub", source="someorg/some-model", method="collapse/shortgpt")
    assert ModelCard.load(hub / "README.md").data.base_model == "someorg/some-model"
    plain = save(tiny_llama, tmp_path / "plain", source=str(tmp_path / "no-card-dir-missing"), method="collapse/laco")
    assert ModelCard.load(plain / "README.md").data.base_model is None and not (plain / "recipe.yaml").exists()


def test_command_line_is_recorded_exactly():
    assert command_line(["/x/llmcompress/__main__.py", "collapse", "--pareto", "--out", "my runs/a"]) == \
        "llmcompress collapse --pareto --out 'my runs/a'"
    assert command_line(["/venv/bin/llmcompress", "nas", "--target-bits", "4"]) == "llmcompress nas --target-bits 4"
    assert command_line(["/venv/bin/pytest", "-q"]) is None


def test_push_to_hub_offline_is_one_line_and_runs_nothing(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLMCOMPRESS_PROGRESS": "0"}
    for cmd in (["collapse", "--pareto"], ["distill", "--keep-layers", "2"], ["nas", "--target-bits", "4"]):
        r = subprocess.run([sys.executable, "-m", "llmcompress", *cmd, "--out", str(tmp_path / "o"), "--push-to-hub", "me/model"],
                           capture_output=True, text=True, env=env, timeout=120)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "--push-to-hub: the hub is unreachable" in lines[0], (cmd, r.stderr)
    r = subprocess.run([sys.executable, "-m", "llmcompress", "collapse", "--pareto", "--save", "all", "--push-to-hub", "me/m",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "uploads one model" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
