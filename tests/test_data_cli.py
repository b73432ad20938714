"""`llmcompress data`: list finds/misses against a data directory, add registers local copies the resolver reads,
fetch offline is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmcompress.errors import DataError


def data(*args, data_dir):
    env = {**os.environ, "LLMCOMPRESS_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "llmcompress", "data", *args], capture_output=True, text=True, env=env, timeout=120)


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_list_shows_found_and_missing(tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "wiki.test.raw").write_text(" = Title = \n some text \n")
    proc = data("list", "--json", data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cat = {r["name"]: r for r in json.loads(proc.stdout)["datasets"]}
    assert set(cat) == {"wikitext2", "tinyshakespeare", "piqa"}
    wt = cat["wikitext2"]["splits"]
    assert wt["test"] == {"found": str(tmp_path / "wikitext-2" / "wiki.test.raw"), "via": "data dir"}
    assert wt["valid"]["found"] is None and cat["piqa"]["splits"]["valid"]["found"] is None
    text = data("list", data_dir=tmp_path).stdout
    assert "llmcompress data fetch piqa" in text and "llmcompress data add tinyshakespeare" in text
    assert "llmcompress data fetch wikitext2" in text  # two of its three splits are missing


def test_add_then_list_and_resolve(tmp_path, monkeypatch):
    from llmcompress.data.blocks import split_sources
    from llmcompress.data.sources import load_texts

    store = tmp_path / "elsewhere"
    store.mkdir()
    (store / "mine.txt").write_text("my own corpus, line one.\nline two.\n")
    shakes = store / "input.txt"
    shakes.write_text("".join(f"line {i} of the play\n" for i in range(100)))
    (store / "wiki.test.raw").write_text(" = Heading = \n Wiki text here .\n")
    ddir = tmp_path / "data"
    assert data("add", "mycorpus", str(store / "mine.txt"), data_dir=ddir).returncode == 0
    assert data("add", "tinyshakespeare", str(shakes), data_dir=ddir).returncode == 0
    assert data("add", "wikitext2", str(store), data_dir=ddir).returncode == 0  # a folder: its files by name
    cat = {r["name"]: r for r in json.loads(data("list", "--json", data_dir=ddir).stdout)["datasets"]}
    assert cat["mycorpus"]["splits"] == {"all": {"found": str(store / "mine.txt"), "via": "registry"}}
    assert cat["wikitext2"]["splits"]["test"]["via"] == "registry" and cat["wikitext2"]["splits"]["valid"]["found"] is None
    assert {s["via"] for s in cat["tinyshakespeare"]["splits"].values()} == {"registry"}
    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(ddir))
    assert load_texts("mycorpus") == ["my own corpus, line one.\nline two.\n"]
    assert load_texts("wikitext2") == [" = Heading = \n Wiki text here .\n"]
    full = shakes.read_text()
    assert load_texts("tinyshakespeare", "valid") == [full[int(len(full) * 0.9):]]  # the named split rule still applies
    assert split_sources("mycorpus:all,wikitext2", "test") == [("mycorpus", "all"), ("wikitext2", "test")]
    with pytest.raises(DataError, match="no split 'train'"):
        load_texts("mycorpus", "train")


def test_add_bad_input_is_one_line_and_writes_nothing(tmp_path):
    ddir = tmp_path / "data"
    one_line_error(data("add", "x", str(tmp_path / "nope.txt"), data_dir=ddir), "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(data("add", "wikitext2", str(tmp_path / "empty"), data_dir=ddir), "holds none of wikitext2's files")
    (tmp_path / "f.txt").write_text("text")
    one_line_error(data("add", "self", str(tmp_path / "f.txt"), data_dir=ddir), "not a usable dataset name")
    assert not ddir.exists()


def test_fetch_offline_exits_2(tmp_path):
    one_line_error(data("fetch", "wikitext2", data_dir=tmp_path / "data"), "unreachable", "data add wikitext2")
    one_line_error(data("fetch", "tinyshakespeare", data_dir=tmp_path / "data"), "no hub source")
    assert not (tmp_path / "data").exists()
