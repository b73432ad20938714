"""Data sources, detokenization and packing."""

from __future__ import annotations

import pytest
import torch

from llmcompress.data.blocks import pack_blocks, token_stream
from llmcompress.data.sources import detokenize_wikitext, load_texts
from llmcompress.errors import DataError


def test_detokenize_wikitext():
    raw = "The 1 @,@ 000 @-@ year old , 3 @.@ 5 m tall ( roughly ) house 's roof .\n"
    assert detokenize_wikitext(raw) == "The 1,000-year old, 3.5 m tall (roughly) house's roof.\n"


def test_pack_blocks_seeded_is_deterministic_and_disjoint_by_offset():
    ids = torch.arange(1000)
    a = pack_blocks(ids, 10, n_blocks=20, seed=3)
    b = pack_blocks(ids, 10, n_blocks=20, seed=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, pack_blocks(ids, 10, n_blocks=20, seed=4))
    val = pack_blocks(ids, 10, n_blocks=20, seed=3, offset=20)
    starts_a = set(a[:, 0].tolist())
    assert starts_a.isdisjoint(val[:, 0].tolist())
    # every block is a contiguous slice of the stream
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(20, 9, dtype=a.dtype))


def test_pack_blocks_unseeded_takes_the_first_windows():
    ids = torch.arange(55)
    blocks = pack_blocks(ids, 10)
    assert blocks.shape == (5, 10) and blocks[0, 0] == 0 and blocks[-1, -1] == 49


def test_data_shorter_than_one_block_is_an_error():
    with pytest.raises(DataError, match="shorter than one block"):
        pack_blocks(torch.arange(5), 10)


def test_empty_file_and_unknown_name(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_texts(str(empty))
    with pytest.raises(DataError, match="unknown dataset"):
        load_texts("no-such-dataset")


def test_jsonl_needs_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "hello"}\n{"other": 1}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        load_texts(str(f))
    f.write_text('{"text": "hello"}\n{"text": "world"}\n')
    assert load_texts(str(f)) == ["hello", "world"]


@pytest.mark.requires_data("wikitext2", "tinyshakespeare", "piqa")
def test_named_datasets_resolve_from_the_data_dir():
    pytest.importorskip("tokenizers")
    valid = load_texts("wikitext2", "valid")[0]
    assert " @-@ " not in valid and " ," not in valid[:100000]
    test = load_texts("wikitext2")[0]
    assert test.startswith(" \n = Robert Boulter =")
    shakes = load_texts("tinyshakespeare", "valid")[0]
    assert len(shakes) < len(load_texts("tinyshakespeare", "all")[0]) / 5
    piqa = load_texts("piqa")
    assert len(piqa) == 1838 and piqa[0].startswith("Question: ")


def test_token_stream_is_cached_and_identical(tiny_hf_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    first = token_stream(tok, ["hello world", "second doc"])
    assert list((tmp_path / "cache" / "tokens").glob("*.npy"))
    again = token_stream(tok, ["hello world", "second doc"])
    assert torch.equal(first, again)
    assert first.numel() == len("hello world") + 2 + len("second doc")


def test_unreachable_data_falls_back_to_self_text(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    from llmcompress.data.blocks import calibration_blocks
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_DATA_DIR", str(tmp_path / "nodata"))
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    lm = load_model(str(tiny_hf_dir))
    with pytest.raises(DataError, match="unreachable"):
        calibration_blocks(lm.tokenizer, "wikitext2", seq_len=16, n_blocks=3)  # no model: no fallback
    blocks, label = calibration_blocks(lm.tokenizer, "wikitext2", seq_len=16, n_blocks=3, seed=1, model=lm.model)
    assert "notice" in capsys.readouterr().err and label.startswith("self")
    assert blocks.shape == (3, 16) and blocks.max() < 256
    again, _ = calibration_blocks(lm.tokenizer, "self", seq_len=16, n_blocks=3, seed=1, model=lm.model)
    assert torch.equal(blocks, again)  # deterministic under the seed (and cached)


def test_mixed_sources_concatenate_and_draw_blocks_from_all(tiny_hf_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from llmcompress.data.blocks import calibration_blocks, split_sources

    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    a, b = tmp_path / "a.txt", tmp_path / "b:x.txt"  # a colon in a file name stays part of the path
    a.write_text("a" * 160)
    b.write_text("b" * 160)
    blocks, label = calibration_blocks(tok, f"{a},{b}", seq_len=16, n_blocks=100, seed=0)
    assert label == f"{a}+{b}"
    assert blocks.shape == (20, 16)  # every block of both files (n_blocks caps at what there is)
    assert {int(r.unique()[0]) for r in blocks if r.unique().numel() == 1} == {ord("a"), ord("b")}
    only_a, _ = calibration_blocks(tok, str(a), seq_len=16, n_blocks=100, seed=0)
    assert only_a.shape == (10, 16) and bool((only_a == ord("a")).all())
    assert split_sources("wikitext2, tinyshakespeare:all", "valid") == [("wikitext2", "valid"), ("tinyshakespeare", "all")]
    assert split_sources(str(b), "valid") == [(str(b), "valid")]
    with pytest.raises(DataError, match="empty source"):
        split_sources("wikitext2,,piqa", "valid")
    with pytest.raises(DataError, match="cannot be mixed"):
        calibration_blocks(tok, f"self,{a}", seq_len=16, n_blocks=2)



def test_self_text_sampling_resumes_after_an_interruption(tiny_hf_dir, tmp_path, monkeypatch):
    from llmcompress.data.blocks import self_text_blocks
    from llmcompress.io.load import load_model

    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "ref"))
    lm = load_model(str(tiny_hf_dir))
    ref = self_text_blocks(lm.model, lm.tokenizer, 12, 5, seed=2, batch=2)
    assert ref.shape == (5, 12) and not list((tmp_path / "ref").rglob("*.parts"))  # parts removed once whole
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "run"))
    generate, calls, fail_at = lm.model.generate, [], [2]

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) in fail_at:
            raise RuntimeError("interrupted")
        return generate(*a, **kw)

    monkeypatch.setattr(lm.model, "generate", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        self_text_blocks(lm.model, lm.tokenizer, 12, 5, seed=2, batch=2)
    assert not list((tmp_path / "run").rglob("*-5-2-b2.pt"))  # no whole file from a half run
    calls.clear()
    fail_at.clear()
    got = self_text_blocks(lm.model, lm.tokenizer, 12, 5, seed=2, batch=2)
    assert len(calls) == 2  # the first batch was kept; the other two sampled now
    assert torch.equal(got, ref)
