"""distill engine on a tiny LLaMA: loss falls, outputs load, the cache is reused, resume, e2e, layer-map students."""

from __future__ import annotations

import json

import pytest
import torch

from llmcompress.distill import DistillConfig
from llmcompress.distill import engine as engine_mod
from llmcompress.distill.engine import distill

pytestmark = pytest.mark.usefixtures("one_thread")



def make_cfg(teacher, data_file, tmp_path, **kw) -> DistillConfig:
    base = dict(
        teacher=str(teacher), keep_layers=2, train_tokens=32 * 4 * 12, data=str(data_file), seq_len=32, batch_size=4,
        eval_tokens=0, cache_dir=str(tmp_path / "cache"), lr=2e-3, phase1_fraction=0.5,
    )
    base.update(kw)
    return DistillConfig(**base)


def read_log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def student_state(out):
    from safetensors.torch import load_file

    return load_file(str(out / "student" / "model.safetensors"))


def test_layerwise_trains_writes_outputs_and_reuses_cache(tiny_hf_dir, data_file, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path)
    res = distill(cfg, tmp_path / "out")
    out = tmp_path / "out"
    log = read_log(out)
    # the hardest segment's loss falls within its phase-1 steps
    hardest = res.metrics["order"][-1]
    seg_losses = [r["loss"] for r in log if r["phase"] == 1 and r["segment"] == hardest]
    assert len(seg_losses) == res.metrics["steps_phase1"] == 6
    assert sum(seg_losses[-2:]) / 2 < 0.9 * seg_losses[0]  # measured 0.73x-0.8x
    assert {r["phase"] for r in log} == {1, 2}
    assert [r["mix"] for r in log if r["phase"] == 2 and r["segment"] == 1][-1] == 1.0
    # outputs: a plain-transformers checkpoint with the layer map, a report, metrics
    model = AutoModelForCausalLM.from_pretrained(out / "student")
    assert model.config.num_hidden_layers == 2
    manifest = json.loads((out / "student" / "llmcompress.json").read_text())
    assert manifest["layer_map"] == [{"sources": [0]}, {"sources": [3]}]
    assert "peak resident memory" in (out / "report.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "report.json", "report.md", "student", "train_log.jsonl"]  # work/ removed
    # saved in the teacher's source dtype (the tiny teacher is a float32 HF dir), bytes on disk reported
    assert manifest["dtype"] == "float32" and res.metrics["student_dtype"] == "float32"
    assert res.metrics["student_bytes_on_disk"] == (out / "student" / "model.safetensors").stat().st_size
    assert f"{res.metrics['student_bytes_on_disk']:,}" in (out / "report.md").read_text()
    index = tmp_path / "cache" / res.metrics["cache_dir"].split("/")[-1] / "index.json"
    stamp = index.stat().st_mtime_ns
    # a rerun with the same teacher/data/layout reuses the cache; end-to-end steps use its final states
    res2 = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, e2e_steps=2), out, overwrite=True, keep_work=True)
    assert res2.metrics["cache_dir"] == res.metrics["cache_dir"] and index.stat().st_mtime_ns == stamp
    assert [r["step"] for r in read_log(out) if r["phase"] == "e2e"] == [0, 1]
    assert (out / "work" / "state.json").is_file() and (out / "work" / "e2e.json").is_file()  # --keep-work


def test_cross_entropy_term_in_last_segment_and_e2e_steps(tiny_hf_dir, data_file, tmp_path):
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, ce_weight=1.0, e2e_steps=8)
    res = distill(cfg, tmp_path / "out")
    log = read_log(tmp_path / "out")
    last = len(res.segments) - 1
    assert all(("ce" in r) == (r["segment"] == last) for r in log if r["phase"] in (1, 2))
    e2e = [r for r in log if r["phase"] == "e2e"]
    assert len(e2e) == 8 and all(r["loss"] == pytest.approx(r["kl"] + r["ce"], rel=1e-4) for r in e2e)
    assert sum(r["ce"] for r in e2e[-2:]) / 2 < e2e[0]["ce"]  # the student learns the training text
    # the term changes the training: same run without it gives other weights
    ref = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, e2e_steps=8), tmp_path / "ref")
    assert ref.metrics["cache_dir"] == res.metrics["cache_dir"]
    a, b = student_state(tmp_path / "out"), student_state(tmp_path / "ref")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # hard labels alone (no logit KL) still train the last segment on them
    res = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, ce_weight=1.0, kl_weight=0.0), tmp_path / "ce_only")
    tail = [r for r in read_log(tmp_path / "ce_only") if r["phase"] in (1, 2) and r["segment"] == len(res.segments) - 1]
    assert tail and all("ce" in r and "kl" not in r for r in tail)


def test_resume_after_interruption_equals_uninterrupted(tiny_hf_dir, data_file, tmp_path, monkeypatch):
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=3, train_tokens=32 * 4 * 4)
    distill(cfg, tmp_path / "ref")
    real = engine_mod._train_segment
    calls = []

    def interrupted(run, seg, **kw):
        calls.append((kw["phase"], seg.index))
        if len(calls) == 3:  # phase 1, after two segments finished
            raise KeyboardInterrupt
        return real(run, seg, **kw)

    monkeypatch.setattr(engine_mod, "_train_segment", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, tmp_path / "run")
    state = json.loads((tmp_path / "run" / "work" / "state.json").read_text())
    assert len(state["phase1_done"]) == 2
    calls.clear()
    monkeypatch.setattr(engine_mod, "_train_segment", lambda run, seg, **kw: (calls.append((kw["phase"], seg.index)), real(run, seg, **kw))[1])
    distill(cfg, tmp_path / "run", resume=True)
    assert calls[0][0] == 1 and len([c for c in calls if c[0] == 1]) == 1  # only the unfinished segment
    ref, got = student_state(tmp_path / "ref"), student_state(tmp_path / "run")
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
    with pytest.raises(Exception, match="different settings"):
        distill(make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=2), tmp_path / "run", resume=True)


def test_epochs_train_the_budget_over_one_cache_of_fewer_tokens(tiny_hf_dir, data_file, tmp_path):
    from llmcompress.distill.cache import FeatureCache

    budget = 32 * 4 * 12  # 12 steps of 4 blocks of 32 tokens
    res = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, epochs=3), tmp_path / "out")
    assert res.metrics["unique_tokens"] == budget // 3 and res.metrics["train_tokens"] == budget
    assert FeatureCache(res.metrics["cache_dir"]).n_shards == 4  # one teacher pass over the distinct data
    log = read_log(tmp_path / "out")
    for phase, steps in ((1, res.metrics["steps_phase1"]), (2, res.metrics["steps_phase2"])):
        assert steps == 6 and all(len([r for r in log if r["phase"] == phase and r["segment"] == k]) == 6 for k in range(2))
    assert "| passes over the data (--epochs) | 3 |" in (tmp_path / "out" / "report.md").read_text()
    # the same budget in one pass trains on other (more) data: other weights
    one = distill(make_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "one")
    assert one.metrics["unique_tokens"] == budget and one.metrics["cache_dir"] != res.metrics["cache_dir"]
    a, b = student_state(tmp_path / "out"), student_state(tmp_path / "one")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # the baseline takes the same data and budget: 12 steps over the 4 distinct batches
    e2e = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, epochs=3, mode="e2e"), tmp_path / "e2e")
    assert e2e.metrics["unique_tokens"] == budget // 3
    assert [r["step"] for r in read_log(tmp_path / "e2e")] == list(range(12))


def test_bf16_precision_caches_other_features_and_still_trains(tiny_hf_dir, data_file, tmp_path):
    from llmcompress.distill.cache import FeatureCache

    ref = distill(make_cfg(tiny_hf_dir, data_file, tmp_path), tmp_path / "fp32")
    res = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, precision="bf16", e2e_steps=4), tmp_path / "bf16")
    assert res.metrics["cache_dir"] != ref.metrics["cache_dir"]  # its own cache: not the fp32 features
    a, b = FeatureCache(ref.metrics["cache_dir"]).read(0), FeatureCache(res.metrics["cache_dir"]).read(0)
    assert torch.equal(a["ids"], b["ids"])
    last = f"b{len(res.segments)}"
    assert not torch.equal(a[last], b[last])  # the teacher ran under bf16 autocast
    rel = ((a[last].float() - b[last].float()).norm() / a[last].float().norm()).item()
    assert rel < 0.05  # measured ~0.006
    log = read_log(tmp_path / "bf16")
    hardest = res.metrics["order"][-1]
    seg_losses = [r["loss"] for r in log if r["phase"] == 1 and r["segment"] == hardest]
    assert sum(seg_losses[-2:]) / 2 < 0.9 * seg_losses[0]
    assert len([r for r in log if r["phase"] == "e2e"]) == 4
    w_ref, w = student_state(tmp_path / "fp32"), student_state(tmp_path / "bf16")
    assert all(w[k].dtype == torch.float32 for k in w)  # master weights stay fp32
    assert any(not torch.equal(w[k], w_ref[k]) for k in w)
    # the baseline too
    e2e = distill(make_cfg(tiny_hf_dir, data_file, tmp_path, precision="bf16", mode="e2e"), tmp_path / "e2e")
    steps = [r["loss"] for r in read_log(tmp_path / "e2e")]
    assert e2e.metrics["student_layers"] == 2 and sum(steps[-2:]) / 2 < steps[0]


def test_a_run_saved_before_newer_options_resumes_with_their_defaults(tiny_hf_dir, data_file, tmp_path, monkeypatch):
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=3, train_tokens=32 * 4 * 4)
    real = engine_mod._train_segment
    calls = []

    def interrupted(run, seg, **kw):
        calls.append(seg.index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(run, seg, **kw)

    monkeypatch.setattr(engine_mod, "_train_segment", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, tmp_path / "run")
    monkeypatch.setattr(engine_mod, "_train_segment", real)
    path = tmp_path / "run" / "work" / "state.json"
    state = json.loads(path.read_text())
    for key in ("epochs", "ce_weight"):  # what a run of the earlier code saved
        del state["config"][key]
    path.write_text(json.dumps(state))
    with pytest.raises(Exception, match="different settings"):  # a non-default value is still another run
        distill(make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=3, train_tokens=32 * 4 * 4, epochs=2), tmp_path / "run", resume=True)
    res = distill(cfg, tmp_path / "run", resume=True)
    assert res.metrics["student_layers"] == 3 and (tmp_path / "run" / "student" / "model.safetensors").is_file()


def interrupt_then_resume(monkeypatch, cfg, out, loss_fn: str, at_call: int) -> None:
    """Run `cfg` into `out`, interrupted in the `at_call`-th call of `losses.<loss_fn>`, then resume it."""
    from llmcompress.distill import losses as losses_mod

    real, calls = getattr(losses_mod, loss_fn), []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(losses_mod, loss_fn, interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, out)
    monkeypatch.setattr(losses_mod, loss_fn, real)
    distill(cfg, out, resume=True)


@pytest.mark.requires_data("wikitext2")
def test_e2e_baseline_mode_and_its_resume(tiny_hf_dir, data_file, tmp_path, monkeypatch):
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, mode="e2e", eval_tokens=512, eval_seq_len=128)
    res = distill(cfg, tmp_path / "out")
    assert res.metrics["student_before/ppl/wikitext2"] > 1 and res.metrics["ppl/wikitext2"] > 1
    losses = [r["loss"] for r in read_log(tmp_path / "out") if r["phase"] == "e2e"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0]
    assert res.metrics["student_layers"] == 2 and (tmp_path / "out" / "student" / "llmcompress.json").is_file()
    interrupt_then_resume(monkeypatch, cfg, tmp_path / "run", "kl_logits", at_call=8)
    steps = [r["step"] for r in read_log(tmp_path / "run")]
    assert steps == list(range(7)) + list(range(6, 12))  # continued from the checkpoint after step 6
    ref, got = student_state(tmp_path / "out"), student_state(tmp_path / "run")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)


def test_e2e_steps_resume_from_their_last_quarter(tiny_hf_dir, data_file, tmp_path, monkeypatch):
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, e2e_steps=8)
    distill(cfg, tmp_path / "ref")
    # interrupted during e2e step 7; checkpoints are written every 2 steps (a quarter of 8)
    interrupt_then_resume(monkeypatch, cfg, tmp_path / "run", "logit_objective", at_call=8)
    steps = [r["step"] for r in read_log(tmp_path / "run") if r["phase"] == "e2e"]
    assert steps == list(range(7)) + list(range(6, 8))  # continued from the checkpoint after step 6
    ref, got = student_state(tmp_path / "ref"), student_state(tmp_path / "run")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)


@pytest.mark.requires_data("wikitext2")
def test_student_checkpoint_with_layer_map(tiny_hf_dir, data_file, tmp_path):
    """A collapse-style student (layers merged from several teacher layers) distils against its teacher."""
    from llmcompress.io.checkpoint import build_manifest, save_checkpoint
    from llmcompress.io.load import load_model
    from llmcompress.io.surgery import keep_layers

    lm = load_model(str(tiny_hf_dir))
    keep_layers(lm.model, [1, 3])
    layer_map = [{"sources": [0, 1], "how": "test"}, {"sources": [2, 3]}]
    manifest = build_manifest(source=str(tiny_hf_dir), source_hash="", method="collapse", extra={"layer_map": layer_map})
    save_checkpoint(lm.model, lm.tokenizer, tmp_path / "student-in", manifest=manifest)
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=None, student=str(tmp_path / "student-in"), segments=1,
                   eval_tokens=512, eval_seq_len=128)
    res = distill(cfg, tmp_path / "out")
    assert [(s.teacher_start, s.teacher_end) for s in res.segments] == [(0, 4)]
    m = res.metrics
    assert all(isinstance(m[k], float) and m[k] > 1 for k in ("teacher/ppl/wikitext2", "student_before/ppl/wikitext2", "ppl/wikitext2"))
    assert "student perplexity after" in (tmp_path / "out" / "report.md").read_text()
    assert json.loads((tmp_path / "out" / "student" / "llmcompress.json").read_text())["layer_map"] == layer_map


def test_e2e_lr_sets_the_e2e_steps_rate(tiny_hf_dir, data_file, tmp_path):
    """--e2e-lr defaults to a quarter of --lr (same weights when given explicitly); another value trains otherwise."""
    runs = {name: make_cfg(tiny_hf_dir, data_file, tmp_path, e2e_steps=4, e2e_lr=e2e_lr)
            for name, e2e_lr in (("default", None), ("quarter", 2e-3 * 0.25), ("full", 2e-3))}
    states = {}
    for name, cfg in runs.items():
        distill(cfg, tmp_path / name)
        states[name] = student_state(tmp_path / name)
    for k in states["default"]:
        torch.testing.assert_close(states["quarter"][k], states["default"][k], rtol=0, atol=0)
    assert any(not torch.equal(states["full"][k], states["default"][k]) for k in states["default"])


def test_resume_of_a_finished_run_is_refused_without_work(tiny_hf_dir, data_file, tmp_path):
    """A finished run's work/ is removed (issue 25, finding 12); --resume on it is still checked, then refused."""
    cfg = make_cfg(tiny_hf_dir, data_file, tmp_path, keep_layers=3, train_tokens=32 * 4 * 4)
    distill(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "work").exists()
    with pytest.raises(Exception, match="holds a finished run"):
        distill(cfg, tmp_path / "run", resume=True)
