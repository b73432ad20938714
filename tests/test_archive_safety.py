"""`unzip` never writes or reads outside its directories, checks llmz.json's checksum and shape, and turns
a full disk into one line (issue 25, findings 7, 8 and the malformed-index part of 11)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmcompress.errors import UserError
from llmcompress.lossless import container

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llmcompress", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def zipped(tmp_path_factory) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    src = tmp_path_factory.mktemp("ck") / "tiny"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    out = src.parent / "zipped"
    container.zip_checkpoint(src, out)
    return out


def _tampered(zipped: Path, tmp_path: Path, edit, *, rehash: bool) -> Path:
    """A copy of the archive with llmz.json edited; `rehash` recomputes its checksum (a careful attacker)."""
    bad = tmp_path / "bad"
    shutil.copytree(zipped, bad)
    m = json.loads((bad / "llmz.json").read_text())
    m = edit(m) or m
    if rehash and isinstance(m, dict):
        m["index_sha256"] = container.index_digest(m)
    (bad / "llmz.json").write_text(json.dumps(m))
    return bad


def _rename_first(name):
    def edit(m):
        m["files"][0]["name"] = name
    return edit


def _one_line_exit_2(r, needle):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_index_carries_a_checksum_that_is_checked(zipped, tmp_path):
    m = json.loads((zipped / "llmz.json").read_text())
    assert m["index_sha256"] == container.index_digest(m)
    bad = _tampered(zipped, tmp_path, _rename_first("other.safetensors"), rehash=False)
    _one_line_exit_2(_cli("unzip", bad, "--out", tmp_path / "out"), "fails its checksum")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../../escaped.safetensors", "ABS", "sub/dir.safetensors", "..", ""])
def test_unzip_refuses_names_outside_out_before_writing(zipped, tmp_path, name):
    target = tmp_path / "victim" / "escaped.safetensors"
    name = str(target) if name == "ABS" else name
    bad = _tampered(zipped, tmp_path, _rename_first(name), rehash=True)
    out = tmp_path / "deep" / "er" / "out"
    _one_line_exit_2(_cli("unzip", bad, "--out", out), "not a plain file name")
    assert not out.exists() and not target.exists() and not (tmp_path / "deep" / "escaped.safetensors").exists()
    assert not any(p.name.endswith(".safetensors") for p in tmp_path.rglob("*") if "bad" not in p.parts)


def test_unzip_refuses_copied_names_and_symlinks_that_escape(zipped, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")

    def copy_secret(m):
        m["copied"].append("../secret.txt")
    bad = _tampered(zipped, tmp_path, copy_secret, rehash=True)
    with pytest.raises(UserError, match="not a plain file name"):
        container.unzip_checkpoint(bad, tmp_path / "out")
    shutil.rmtree(bad)
    bad = _tampered(zipped, tmp_path, lambda m: None, rehash=True)
    (bad / "config.json").unlink()
    (bad / "config.json").symlink_to(secret)  # a copied file that is a link out of the archive
    with pytest.raises(UserError, match="link"):
        container.unzip_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", ["[]", '{"files": "model.safetensors"}', '{"files": [{}]}', '{"files": [1]}',
                                   '{"files": [{"name": "a.safetensors", "llmz": "a.llmz", "size": "big"}]}', "{nope"])
def test_malformed_index_is_exit_2(zipped, tmp_path, index):
    bad = tmp_path / "bad"
    shutil.copytree(zipped, bad)
    (bad / "llmz.json").write_text(index)
    _one_line_exit_2(_cli("unzip", bad, "--out", tmp_path / "out"), "corrupt zipped checkpoint")
    assert not (tmp_path / "out").exists()


class _FullDisk:
    """A file whose writes fail with ENOSPC once `room` bytes are written (a disk that fills up)."""

    def __init__(self, path, mode, room):
        self._f, self._room = open(path, mode), room

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):  # reads and the rest go to the real file
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("op", ["zip", "unzip"])
def test_disk_full_is_one_line_and_leaves_nothing(zipped, tmp_path, monkeypatch, op):
    monkeypatch.setattr(container, "open", lambda path, mode="r": _FullDisk(path, mode, 1000), raising=False)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"no space left on .* \(needs ~\d+ MB\)"):
        if op == "zip":
            src = tmp_path / "src"
            shutil.copytree(zipped.parent / "tiny", src)
            container.zip_checkpoint(src, out)
        else:
            container.unzip_checkpoint(zipped, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # temp dirs removed
