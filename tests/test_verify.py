"""`llmcompress verify`: per-file sha256 digests in llmcompress.json catch bit flips that safetensors (no
checksum) loads silently (issue 25, finding 12's bit-flip part; build item 5's optional verify)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import tiny_model

from llmcompress.errors import UserError
from llmcompress.io.checkpoint import build_manifest, save_checkpoint, verify_checkpoint


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llmcompress", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "LLMCOMPRESS_PROGRESS": "0"}, timeout=300)


@pytest.fixture
def ckpt(tmp_path):
    manifest = build_manifest(source="tiny", source_hash="0" * 64, method="test")
    return save_checkpoint(tiny_model("llama", layers=2), None, tmp_path / "ckpt", manifest=manifest)


def test_manifest_records_every_file_and_verify_passes(ckpt):
    digests = json.loads((ckpt / "llmcompress.json").read_text())["files_sha256"]
    assert set(digests) == {p.name for p in ckpt.iterdir()} - {"llmcompress.json"}
    assert "model.safetensors" in digests and "config.json" in digests
    r = _cli("verify", ckpt)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ok: {len(digests)} file(s)")


def test_a_bit_flip_in_tensor_data_is_caught(ckpt):
    from llmcompress.io.load import resolve

    st = ckpt / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor: the header checks and safetensors itself accept the file
    st.write_bytes(bytes(data))
    assert resolve(str(ckpt))[0] == "dir"
    r = _cli("verify", ckpt)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "changed: model.safetensors" in lines[0], r.stderr


def test_missing_file_and_old_manifest(ckpt):
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    (ckpt / "config.json").unlink()
    with pytest.raises(UserError, match="missing: config.json"):
        verify_checkpoint(ckpt)
    m = json.loads((ckpt / "llmcompress.json").read_text())
    del m["files_sha256"]
    (ckpt / "llmcompress.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="records no file digests"):
        verify_checkpoint(ckpt)
