"""io/rundir.py: claiming --out, the "same run?" fingerprint, stale-file cleanup, JSON + safetensors run state."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from llmcompress.errors import OutputExists
from llmcompress.io.rundir import claim, fingerprint, load_state, save_state


def test_fingerprint_ignores_skipped_keys_and_key_order_and_keeps_the_old_hashes():
    a = {"model": "m", "seed": 0, "eval_tokens": 10, "lr": 1e-3}
    assert fingerprint(a, skip=["eval_tokens"]) == fingerprint({**a, "eval_tokens": 99}, skip=["eval_tokens"])
    assert fingerprint(dict(reversed(a.items()))) == fingerprint(a)
    assert fingerprint(a) != fingerprint({**a, "seed": 1})
    # the bytes the collapse and nas configs hashed before (saved search states must still resume)
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.nas.config import NasConfig

    for cfg, skip in [(CollapseConfig(pareto=True), {"save", "eval_tokens", "eval_seq_len", "piqa_limit", "max_cache_gb", "generations", "save_dtype", "prefix_cache_gb", "racing"}),
                      (NasConfig(target_bits=4.0), {"eval_tokens", "eval_seq_len", "measure_speed", "checkpoint_every", "baselines", "export", "save_dtype"})]:
        d = {k: v for k, v in cfg.to_dict().items() if k not in skip}
        assert cfg.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _old_run(out):
    out.mkdir()
    for name in ("search_state.json", "search_log.jsonl", "mine.txt"):
        (out / name).write_text("x")
    (out / "work").mkdir()
    (out / "work" / "state.json").write_text("{}")


STALE = ("search_*.json*", "work")


def test_claim_refuses_an_existing_run_and_writes_nothing(tmp_path):
    _old_run(tmp_path / "run")
    with pytest.raises(OutputExists, match="already exists"):
        claim(tmp_path / "run", stale=STALE)
    rd = claim(tmp_path / "new", stale=STALE)
    assert not (tmp_path / "new").exists()  # nothing until start(): bad input found later leaves no folder
    rd.start()
    assert (tmp_path / "new").is_dir()


def test_overwrite_removes_exactly_the_stale_files_and_resume_keeps_them(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    claim(out, resume=True, stale=STALE).start()
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt", "search_log.jsonl", "search_state.json", "work"]
    rd = claim(out, overwrite=True, stale=STALE)
    assert (out / "work").is_dir()  # claiming removes nothing
    rd.start()
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # files no pattern names are the user's


def test_state_round_trip_keeps_types_int_keys_and_tied_tensors(tmp_path):
    w = torch.randn(4, 3)
    state = {"step": 3, "name": "a", "none": None, "betas": (0.9, 0.999), "by_id": {0: torch.ones(2), 5: {"x": 1.5}},
             "tied": {"embed": w, "head": w}, "view": w[1], "half": torch.arange(6, dtype=torch.bfloat16), "scalar": torch.tensor(7.0),
             "__tensor__": "a key that looks like a marker"}
    save_state(tmp_path / "s.json", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.safetensors"]
    got = load_state(tmp_path / "s.json")
    assert got["step"] == 3 and got["name"] == "a" and got["none"] is None and got["betas"] == (0.9, 0.999)
    assert set(got["by_id"]) == {0, 5} and got["by_id"][5] == {"x": 1.5} and torch.equal(got["by_id"][0], torch.ones(2))
    assert torch.equal(got["tied"]["embed"], w) and torch.equal(got["tied"]["head"], w) and torch.equal(got["view"], w[1])
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], state["half"]) and got["scalar"].item() == 7.0
    assert got["__tensor__"] == state["__tensor__"]
    assert load_state(tmp_path / "missing.json") is None


def test_an_optimizer_resumed_from_the_state_continues_bit_for_bit(tmp_path):
    def setup():
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8)
        return layer, torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)

    def step(layer, opt, i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        opt.step()

    ref, ref_opt = setup()
    for i in range(4):
        step(ref, ref_opt, i)
    layer, opt = setup()
    for i in range(2):
        step(layer, opt, i)
    save_state(tmp_path / "ck.json", {"layers": layer.state_dict(), "opt": opt.state_dict()})
    layer, opt = setup()
    st = load_state(tmp_path / "ck.json")
    layer.load_state_dict(st["layers"])
    opt.load_state_dict(st["opt"])
    for i in range(2, 4):
        step(layer, opt, i)
    for a, b in zip(layer.parameters(), ref.parameters()):
        assert torch.equal(a, b)
