"""distill with a streamed teacher (distill/stream.py): the layer-wise phases run layer by layer from disk and train
the same student as in memory; what needs the whole model is refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

from llmcompress.distill import DistillConfig
from llmcompress.distill.engine import distill
from llmcompress.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")



def _cfg(teacher, data_file, tmp_path, **kw) -> DistillConfig:
    base = dict(teacher=str(teacher), keep_layers=2, select="bi", train_tokens=32 * 4 * 8, data=str(data_file), seq_len=32,
                batch_size=4, eval_tokens=0, cache_dir=str(tmp_path / "cache"), lr=2e-3, phase1_fraction=0.5, ce_weight=0.5)
    base.update(kw)
    return DistillConfig(**base)


def _student(out) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "student").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _losses(out) -> list[tuple]:
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    return [(r["phase"], r["segment"], r["step"], r["loss"]) for r in recs]


def _segment_budget(path) -> int:
    """A --max-memory below the teacher's float32 bytes that one student layer's segment still trains in (so the run
    streams, and its feature cache takes one batch per chunk)."""
    from llmcompress.distill.stream import layer_bytes, segment_need
    from llmcompress.io.stream import checkpoint_bytes_at

    need, _ = segment_need(2, None, max(layer_bytes(path).values()))
    assert need < checkpoint_bytes_at(path, torch.float32)
    return need + 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_layerwise_trains_the_in_memory_student(dtype, tiny_hf_dir, data_file, tmp_path, monkeypatch):
    """--max-memory below the teacher streams it: Block Influence, the feature cache (one batch per chunk here),
    both phases and the sharded save give the in-memory run's student, the teacher never loaded whole; a bf16
    checkpoint (its head kept in bf16 while streamed) trains as in memory in float32; an interrupted streamed
    run resumes to the same student."""
    from transformers import AutoModelForCausalLM

    from llmcompress.distill import engine as engine_mod

    if dtype == "bfloat16":
        AutoModelForCausalLM.from_pretrained(tiny_hf_dir).to(torch.bfloat16).save_pretrained(tiny_hf_dir)

    mem = distill(_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "mem")
    assert mem.metrics["streamed"] is False

    import llmcompress.io.load as load_mod

    loaded = []
    real_load = load_mod.load_model
    monkeypatch.setattr(load_mod, "load_model", lambda *a, **k: loaded.append(a) or real_load(*a, **k))
    budget = _segment_budget(tiny_hf_dir)
    streamed = distill(_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "str", max_memory=budget)
    assert loaded == [] and streamed.metrics["streamed"] is True  # the teacher was never loaded whole
    assert streamed.layer_map == mem.layer_map and streamed.metrics["order"] == mem.metrics["order"]
    assert streamed.metrics["cache_dir"] != mem.metrics["cache_dir"]  # its own cache, built layer by layer
    a, b = _losses(tmp_path / "mem"), _losses(tmp_path / "str")
    assert [r[:3] for r in a] == [r[:3] for r in b]
    assert [r[3] for r in b] == pytest.approx([r[3] for r in a], rel=1e-4)
    sa, sb = _student(tmp_path / "mem"), _student(tmp_path / "str")
    assert sorted(sa) == sorted(sb)
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-5)
    # trained: the streamed student is not the untrained cut of the teacher
    teacher = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=getattr(torch, dtype)).state_dict()
    keep = [s["sources"][0] for s in mem.layer_map]
    assert not torch.allclose(sb["model.layers.1.mlp.down_proj.weight"], teacher[f"model.layers.{keep[1]}.mlp.down_proj.weight"])
    # the sharded checkpoint loads in transformers with the manifest of an in-memory save
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "str" / "student")
    assert model.config.num_hidden_layers == 2
    ma = json.loads((tmp_path / "mem" / "student" / "llmcompress.json").read_text())
    mb = json.loads((tmp_path / "str" / "student" / "llmcompress.json").read_text())
    assert mb["layer_map"] == ma["layer_map"] and mb["parameters"] == ma["parameters"] and mb["dtype"] == ma["dtype"]
    assert "streamed layer by layer" in (tmp_path / "str" / "report.md").read_text()
    assert mb["dtype"] == dtype and sb["model.layers.0.mlp.up_proj.weight"].dtype == getattr(torch, dtype)  # the source's
    if dtype != "float32":
        return

    # interrupted in phase 1's second segment, resumed and interrupted again while phase 2 propagates its first
    # segment's outputs (the resume re-propagates from that segment's phase-2 file), resumed: the same student
    def interrupt(name, at):
        real, calls = getattr(engine_mod, name), {"n": 0}

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] == at:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(engine_mod, name, flaky)
        return real

    for name, at in (("_train_segment", 2), ("_propagate", 1)):
        real = interrupt(name, at)
        with pytest.raises(KeyboardInterrupt):
            distill(_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "res", max_memory=budget, resume=name != "_train_segment")
        monkeypatch.setattr(engine_mod, name, real)
    state = json.loads((tmp_path / "res" / "work" / "state.json").read_text())
    assert state["phase1_done"] and state["phase2_done"] == [0]  # the second interruption came in phase 2
    distill(_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "res", max_memory=budget, resume=True)
    sr = _student(tmp_path / "res")
    assert all(torch.equal(sr[k], sb[k]) for k in sb)


@pytest.mark.requires_data("wikitext2")
def test_streamed_checkpoint_student_and_perplexities_equal_in_memory(tiny_hf_dir, data_file, tmp_path):
    """A --student checkpoint (collapse-style layer map) streamed too, all batches in one chunk (--max-memory 0:
    the machine's memory), and the report's three perplexities measured layer by layer: as in memory."""
    from llmcompress.io.checkpoint import build_manifest, save_checkpoint
    from llmcompress.io.load import load_model
    from llmcompress.io.surgery import keep_layers

    lm = load_model(str(tiny_hf_dir))
    keep_layers(lm.model, [1, 3])
    manifest = build_manifest(source=str(tiny_hf_dir), source_hash="", method="collapse",
                              extra={"layer_map": [{"sources": [0, 1]}, {"sources": [2, 3]}]})
    save_checkpoint(lm.model, lm.tokenizer, tmp_path / "student-in", manifest=manifest)
    kw = dict(keep_layers=None, select="uniform", student=str(tmp_path / "student-in"), eval_tokens=512, eval_seq_len=128)
    mem = distill(_cfg(tiny_hf_dir, data_file, tmp_path, **kw), tmp_path / "mem")
    st = distill(_cfg(tiny_hf_dir, data_file, tmp_path, **kw), tmp_path / "str", max_memory=0)
    assert st.metrics["streamed"] and not mem.metrics["streamed"]
    for key in ("teacher/ppl/wikitext2", "student_before/ppl/wikitext2", "ppl/wikitext2"):
        assert st.metrics[key] == pytest.approx(mem.metrics[key], rel=1e-4), key
    assert mem.metrics["ppl/wikitext2"] < mem.metrics["student_before/ppl/wikitext2"]  # it trained
    sa, sb = _student(tmp_path / "mem"), _student(tmp_path / "str")
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw, named", [({"mode": "e2e"}, "--mode e2e"), ({"e2e_steps": 2}, "--e2e-steps"), ({"data": "self"}, "--data self")])
def test_streaming_refuses_what_needs_the_whole_model(tiny_hf_dir, data_file, tmp_path, kw, named):
    """--max-memory 0 (always stream) with an option that runs the whole model: one line naming it, nothing written."""
    out = tmp_path / "out"
    with pytest.raises(UserError) as err:
        distill(_cfg(tiny_hf_dir, data_file, tmp_path, **kw), out, max_memory=0)
    assert named in str(err.value) and "--mode layerwise" in err.value.hint
    assert not out.exists() and not (tmp_path / "cache").exists()
    # a budget it does not fit is refused as well (it would be killed loading)
    with pytest.raises(UserError, match="--max-memory"):
        distill(_cfg(tiny_hf_dir, data_file, tmp_path, **kw), out, max_memory=1)
    assert not out.exists()


def test_streamed_segment_above_the_budget_is_refused_before_anything_is_written(tiny_hf_dir, data_file, tmp_path):
    """--segments 1 trains both student layers at once: with a budget for one layer's segment, one line naming the
    fix (--segments 2), nothing written; the same budget with one layer per segment streams."""
    out = tmp_path / "out"
    with pytest.raises(UserError, match="trains with its float32 weights") as err:
        distill(_cfg(tiny_hf_dir, data_file, tmp_path, segments=1), out, max_memory=_segment_budget(tiny_hf_dir))
    assert "--segments 2" in err.value.hint and not out.exists() and not (tmp_path / "cache").exists()
