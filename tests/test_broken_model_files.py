"""Broken model files are exit 2 naming the file and a fix: GGUF files (empty, text, corrupt header,
truncated), safetensors headers in a model directory and in our own conversion cache (rebuilt), and missing
paths (issue 25, findings 6, 9 and the GGUF/safetensors/path part of 11)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmcompress.errors import UserError
from llmcompress.io import load


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(d))
    return d


def write_gguf(path: Path) -> Path:
    """A small well-formed GGUF (llama metadata, two float tensors) written with the gguf package."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.random((64, 96), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.random((32, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _damaged(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.gguf"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not a model\n" * 20)
    else:
        data = write_gguf(tmp_path / "good.gguf").read_bytes()
        if kind == "version":
            data = data[:4] + (99).to_bytes(4, "little") + data[8:]
        elif kind == "header":  # magic and version intact, tensor/metadata counts garbage
            data = data[:8] + b"\xff" * 16 + data[24:]
        elif kind == "truncated":
            data = data[: len(data) * 2 // 3]
        path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind,needle", [
    ("empty", "is empty"),
    ("text", "not a GGUF file"),
    ("version", "corrupt GGUF header"),
    ("header", "corrupt or truncated GGUF file"),
    ("truncated", "corrupt or truncated GGUF file"),
])
def test_damaged_gguf_is_a_user_error_naming_the_file(tmp_path, cache, kind, needle):
    path = _damaged(tmp_path, kind)
    with pytest.raises(UserError) as exc:
        load.load_model(str(path))
    assert needle in exc.value.message and str(path) in exc.value.message
    assert "re-download" in exc.value.hint or "pass a .gguf" in exc.value.hint
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())  # no half conversion


def test_truncated_gguf_through_the_cli_is_exit_2(tmp_path, cache):
    path = _damaged(tmp_path, "truncated")
    r = subprocess.run([sys.executable, "-m", "llmcompress", "info", str(path)], capture_output=True, text=True,
                       env={**os.environ, "LLMCOMPRESS_PROGRESS": "0"}, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: corrupt or truncated GGUF file") and str(path) in lines[0], r.stderr


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_cache_of_a_converted_model_is_rebuilt(tmp_path, cache, tiny_hf_dir, monkeypatch, capsys, damage):
    gguf = write_gguf(tmp_path / "m.gguf")
    conversions = []

    def fake_convert(src: Path, out: Path) -> None:  # transformers' GGUF loader is not under test here
        conversions.append(out)
        shutil.copytree(tiny_hf_dir, out)
        (out / "source.json").write_text(json.dumps({"gguf": str(src), "sha256": "0" * 64}))

    monkeypatch.setattr(load, "_convert_gguf", fake_convert)
    load.load_model(str(gguf))
    assert len(conversions) == 1
    st = conversions[0] / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    lm = load.load_model(str(gguf))  # a truncated cache used to fail with a raw SafetensorError
    assert len(conversions) == 2 and lm.config.num_hidden_layers == 4
    err = capsys.readouterr().err
    assert f"the cached conversion {conversions[0]} is damaged" in err and "rebuilding it" in err
    load.load_model(str(gguf))  # healthy again: not converted a third time
    assert len(conversions) == 2


def test_damaged_cache_that_cannot_be_removed_says_what_to_delete(tmp_path, cache, tiny_hf_dir, monkeypatch):
    gguf = write_gguf(tmp_path / "m.gguf")
    cached = load.gguf_cache_dir(gguf)
    shutil.copytree(tiny_hf_dir, cached)
    (cached / "source.json").write_text(json.dumps({"sha256": "0" * 64}))
    (cached / "model.safetensors").write_bytes(b"\x10")
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(UserError) as exc:
        load.load_model(str(gguf))
    assert f"delete {cached}" in exc.value.hint


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": "x"}}', b"\xff\xfe{}"])
def test_malformed_safetensors_header_in_a_model_dir(tiny_hf_dir, header):
    st = tiny_hf_dir / "model.safetensors"
    st.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(UserError, match=f"corrupt checkpoint file {st}"):
        load.resolve(str(tiny_hf_dir))


def test_missing_relative_path_with_a_slash_is_not_a_hub_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(UserError, match="runs/student does not exist"):
        load.resolve("runs/student")
    with pytest.raises(UserError, match="does not exist"):
        load.resolve("runs/collapse/models/x")
    assert load.resolve("some-org/some-model")[0] == "hub"  # ORG/NAME with no local ORG folder stays a hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="is no local path and could not be fetched from the hub"):
        load.load_model("some-org/some-model")
