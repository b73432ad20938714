"""The collapse search streamed layer by layer (collapse/stream.py, `Evaluator(runner=)`): on a tiny LLaMA built
from config and saved as safetensors, the streamed reference and fitness equal the in-memory ones (float32,
within 1e-5 relative: the reference's head runs on the scored positions only, and the layers see the same
batches), and a seeded search with its baselines returns the same front and the same picks."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model

from llmcompress.collapse.baselines import shortgpt
from llmcompress.collapse.config import CollapseConfig
from llmcompress.collapse.fitness import Evaluator, build_reference, build_reference_streamed
from llmcompress.collapse.space import Candidate
from llmcompress.io.stream import LayerRunner

RTOL = 1e-5


@pytest.fixture
def pair(tmp_path):
    """(in-memory evaluator, streamed evaluator) of one tiny 8-layer LLaMA on the same blocks."""
    model = tiny_model("llama", layers=8)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    cb, vb = torch.randint(3, TINY_VOCAB, (6, 24), generator=g), torch.randint(3, TINY_VOCAB, (3, 24), generator=g)
    kw = dict(topk=16, stride=2, max_bytes=1e9)
    mem = Evaluator(model, build_reference(model, cb, batch=3, **kw), build_reference(model, vb, batch=3, **kw), batch=3,
                    prefix_bytes=2**26)
    runner = LayerRunner.open(path, dtype=torch.float32, batch=3)
    st = Evaluator(runner.model, build_reference_streamed(runner, cb, **kw), build_reference_streamed(runner, vb, **kw), batch=3,
                   prefix_bytes=2**26, runner=runner)
    yield mem, st
    st.close()
    runner.close()


def _merge(groups, alphas):
    return Candidate(tuple(tuple(g) for g in groups), tuple(tuple(tuple(a) for a in al) for al in alphas))


CANDS = [
    Candidate.from_keep(8, {3}),  # one layer dropped
    Candidate.from_keep(8, {2, 5, 6}),
    # layers 2..4 merged (layer 3 at alpha (1, 0.5, 0.25) per kind, layer 4 dropped), then 6+7 RDSC-merged
    _merge([[0], [1], [2, 3, 4], [5], [6, 7]],
           [[], [], [(1.0, 0.5, 0.25), (0.0, 0.0, 0.0)], [], [(1.0, 1.0, 1.0)]]),
]


def test_streamed_reference_and_fitness_equal_in_memory(pair):
    mem, st = pair
    for split in ("calib", "val"):
        a, b = mem.refs[split], st.refs[split]
        for i in range(len(a.states)):
            torch.testing.assert_close(b.states.all()[i], a.states.all()[i], rtol=RTOL, atol=1e-5)
        assert torch.equal(a.top_idx, b.top_idx)
        torch.testing.assert_close(b.top_logp, a.top_logp, rtol=RTOL, atol=1e-5)
    assert st.total_params == mem.total_params and st.layer_params == mem.layer_params
    for c in CANDS:
        for split in ("calib", "val"):
            fa, fb = mem.evaluate(c, split), st.evaluate(c, split)
            assert fb.fitness == pytest.approx(fa.fitness, rel=RTOL) and fb.kl == pytest.approx(fa.kl, rel=RTOL)
            assert fb.params == fa.params and not fb.partial
        assert st.final_similarity(c, 2, max_tokens=16) == pytest.approx(mem.final_similarity(c, 2, max_tokens=16), rel=RTOL)
    assert st.evaluate(Candidate.from_keep(8, set())).kl == 0.0
    # a candidate sharing a prefix with one scored before starts at the deepest shared boundary, same value
    child = _merge([[0], [1], [2, 3, 4], [5], [6], [7]], [[], [], [(1.0, 0.5, 0.25), (0.0, 0.0, 0.0)], [], [], []])
    hits = st.stats.prefix_hits
    assert st.evaluate(child).fitness == pytest.approx(mem.evaluate(child).fitness, rel=RTOL)
    assert st.stats.prefix_hits == hits + 1


def test_streamed_reference_spills_its_states_as_they_pass_and_maps_nothing(pair):
    """A streamed model is above the memory budget, so its references' boundary states go to disk as they pass
    (whatever `max_bytes` says), and a read maps nothing: a memory map's touched pages would stay in the
    process's resident memory (0.28 GB of the 1.7B bench's 1.26 GB peak when they were mapped)."""
    import os
    from pathlib import Path

    from llmcompress.collapse.baselines import shortgpt_scores

    mem, st = pair
    store, ref = st.refs["calib"].states, mem.refs["calib"].states
    assert store.on_disk and not ref.on_disk and len(store) == len(ref) == 9
    assert sorted(p.name for p in store.folder.iterdir()) == sorted(f"b{i}.safetensors" for i in range(9))
    torch.testing.assert_close(store.get(4, slice(1, 3)), ref.get(4, slice(1, 3)), rtol=RTOL, atol=1e-5)
    screen = store.first(2)  # the walk's screen: a view of the same files, no row past 2, 2 rows' bytes
    assert screen.get(8, slice(None)).shape[0] == 2 and store.get(8, slice(None)).shape[0] == 6
    torch.testing.assert_close(screen.get(8, slice(0, 5)), ref.get(8, slice(0, 2)), rtol=RTOL, atol=1e-5)
    assert screen.nbytes * 3 == store.nbytes == ref.nbytes and len(screen) == len(store)
    screen.close()  # deletes nothing: the store it shares owns the files
    assert store.folder.is_dir()
    if os.path.exists("/proc/self/maps"):
        assert str(store.folder) not in Path("/proc/self/maps").read_text()
    assert shortgpt_scores(st) == pytest.approx(shortgpt_scores(mem), rel=1e-4)  # read one boundary at a time
    folder = store.folder
    st.close()
    assert not folder.exists()


def test_streamed_fitness_reads_only_the_layers_a_group_needs(pair, monkeypatch):
    """A group's dropped layers (every coefficient 0) are never read, and a merged group is built with one
    decoder layer resident: its leader, merged in place from the other sources read tensor by tensor."""
    from contextlib import contextmanager

    mem, st = pair
    runner = st.runner
    read, resident, peak = [], set(), [0]
    real_layer, real_tensor = runner.layer, runner.read_tensor

    @contextmanager
    def spy(i):  # (layer loaded, layers whose single tensors were read while it was built)
        read.append((i, set()))
        resident.add(i)
        peak[0] = max(peak[0], len(resident))
        with real_layer(i) as layer:
            yield layer
        resident.discard(i)

    def spy_tensor(name):  # the layers whose tensors were read while the last loaded layer was built
        read[-1][1].add(int(name.split(".layers.")[1].split(".")[0]))
        return real_tensor(name)

    monkeypatch.setattr(runner, "layer", spy)
    monkeypatch.setattr(runner, "read_tensor", spy_tensor)
    st.evaluate(CANDS[2])
    # the two merged groups' similarity (each once, memoized), then the KL: every layer of the suffix read once;
    # a merged group: its leader loaded, then per merged source the leader's and the source's tensors
    merged_2, merged_6 = (2, {2, 3}), (6, {6, 7})  # group [2, 3, 4]: layer 4 is dropped, never read
    assert read == [merged_2, merged_6, merged_2, (5, set()), merged_6]
    assert peak[0] == 1
    assert all(p.device.type == "meta" for layer in st.layers for p in layer.parameters())  # freed again
    # a group of three merged sources, against the in-memory build
    read.clear()
    three = _merge([[0], [1], [2, 3, 4], [5], [6], [7]], [[], [], [(1.0, 0.5, 0.25), (0.5, 1.0, 0.75)], [], [], []])
    assert st.evaluate(three).fitness == pytest.approx(mem.evaluate(three).fitness, rel=RTOL)
    assert read[:3] == [(2, {2, 3, 4}), (2, {2, 3, 4}), (5, set())]  # the similarity, then the KL
    assert peak[0] == 1


def _search(ev, out, seed):
    from llmcompress.collapse.search import run_search, select_by_validation

    cfg = CollapseConfig(population=4, generations=1, seed=seed, min_layers=5, sim_blocks=1, max_group=3)
    seeds = [shortgpt(ev, n) for n in (5, 6, 7)]
    hist = run_search(cfg, ev, seeds, out, model_id="tiny")
    picks = select_by_validation(ev, 5, 7)
    return ([[c.key for c, _, _ in g.front] for g in hist], [c.key for c, _, _ in picks],
            [f.fitness for g in hist for _, f, _ in g.front] + [v.fitness for _, _, v in picks])


def test_streamed_search_returns_the_in_memory_front(pair, tmp_path):
    mem, st = pair
    fronts_a, picks_a, fit_a = _search(mem, tmp_path / "a", seed=1)
    fronts_b, picks_b, fit_b = _search(st, tmp_path / "b", seed=1)
    assert fronts_a == fronts_b and picks_a == picks_b
    assert fit_b == pytest.approx(fit_a, rel=RTOL)
    assert any(len(g) > 1 for k in picks_b for g in k[0]) or any(len(k[0]) < 8 for k in picks_b)


def test_streamed_candidate_perplexity_equals_the_built_model(pair):
    """The report's perplexity of a candidate, streamed (CollapsedRunner through io.stream.streamed_nll), equals
    that of the candidate's model built in memory."""
    from llmcompress.collapse.export import build_model
    from llmcompress.collapse.stream import CollapsedRunner
    from llmcompress.eval.perplexity import nll_of_blocks
    from llmcompress.io.stream import streamed_nll

    mem, st = pair
    blocks = torch.randint(3, TINY_VOCAB, (4, 20), generator=torch.Generator().manual_seed(5))
    a, n_a = nll_of_blocks(build_model(mem.model, CANDS[2]), blocks, batch_size=2)
    b, n_b = streamed_nll(CollapsedRunner(st.runner, CANDS[2]), blocks)
    assert n_a == n_b and b == pytest.approx(a, rel=RTOL)


def test_collapse_above_max_memory_streams_with_the_in_memory_result(tiny_hf_dir, tmp_path, capsys):
    """run_collapse with max_memory=0 says it streams (one line) and gives the in-memory front, picks and
    checkpoints (same tensors and weights hash; written a group at a time as shards)."""
    import json

    from transformers import AutoModelForCausalLM

    from llmcompress.collapse.pipeline import run_collapse

    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    cfg = dict(model=str(tiny_hf_dir), calib_source=str(text), seq_len=32, calib_tokens=128, val_tokens=64, population=4,
               generations=1, eval_tokens=0, piqa_limit=0, laco_threshold=0.0, min_layers=3, save="all", refine_steps=0,
               tune_steps=0, batch_blocks=2)
    runs = {}
    for arm, budget in (("mem", None), ("stream", 0)):
        capsys.readouterr()
        runs[arm] = run_collapse(CollapseConfig(**cfg), tmp_path / arm, max_memory=budget)
        err = capsys.readouterr().err
        assert ("streaming its layers from disk one at a time for the collapse search" in err) == (arm == "stream"), err
    a, b = runs["mem"], runs["stream"]
    assert [r["name"] for r in a.front] == [r["name"] for r in b.front] and [r["groups"] for r in a.front] == [r["groups"] for r in b.front]
    assert [r["fitness_val"] for r in b.front] == pytest.approx([r["fitness_val"] for r in a.front], rel=RTOL)
    assert len(a.saved) == len(b.saved) > 0
    for pa, pb in zip(a.saved, b.saved):
        ma, mb = (json.loads((p / "llmcompress.json").read_text()) for p in (pa, pb))
        assert ma["weights_sha256"] == mb["weights_sha256"] and ma["layer_map"] == mb["layer_map"]
        assert (ma["layers"], ma["parameters"], ma["dtype"]) == (mb["layers"], mb["parameters"], mb["dtype"])
        assert (pb / "model.safetensors.index.json").is_file()
        sa, sb = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (pa, pb))
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "streamed layer by layer" in json.loads((tmp_path / "stream" / "pareto.json").read_text())["settings"]
