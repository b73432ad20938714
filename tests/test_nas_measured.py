"""`nas --cost-model measured` (nas/measured.py): the NNLS fit, the table cache, plan costs, the missing-runtime
error, and (with llama-cpp-python installed) a probe table of a tiny model measured end to end."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from test_cli import assert_user_error
from test_export import _tiny, bpe_tokenizer  # noqa: F401  (bpe_tokenizer: a fixture used below)
from test_llamacpp import run_without_llama_cpp

from llmcompress.nas import measured as M


def _synthetic_table(shapes: dict[str, str], ftype: str = "BF16") -> tuple[dict[str, float], list[str]]:
    """Costs that grow with bytes per weight, plus a per-type overhead (seconds per token)."""
    bpw = {"Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 0.6875, "Q5_1": 0.75, "Q8_0": 1.0625, ftype: 2.0}
    costs = {}
    for t, b in bpw.items():
        for s in set(shapes.values()):
            o, i = map(int, s.split("x"))
            costs[f"{t}@{s}"] = 1e-9 * b * o * i + 2e-6 * (1 + len(t))
    costs[f"fixed@{M.BASE}"], costs[f"fixed@{ftype}"] = 3e-3, 5e-3
    return costs, sorted(costs)


def _probe_rows(shapes, ftype, layers, columns):
    rows = []
    for _name, kinds, head, n in M.probe_plans(shapes, ftype, layers):
        types = {f"blk.{i}.{k}": f"{t}@{shapes[k]}" for i in range(n) for k, t in kinds.items()}
        rows.append(M.features(types, head, columns))
    return rows


def test_nnls_recovers_known_costs_from_a_full_rank_design():
    rng = np.random.default_rng(0)
    X = rng.integers(0, 5, size=(40, 12)).astype(float)
    c = rng.uniform(0, 1, 12)
    c[[2, 7]] = 0.0  # some true costs at the bound
    got = M.nnls(X, X @ c)
    assert got == pytest.approx(c, abs=1e-9)
    assert (M.nnls(X, X @ c - 5.0) >= 0).all()  # the constraint holds where least squares would go negative


def test_probe_fit_predicts_unseen_configurations_from_synthetic_timings():
    """The probe design pins every prediction for whole-layer models (the split of the per-layer constant
    among shapes is not identifiable, and need not be): noiseless probe times -> exact held-out times."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                                   vocab_size=1000, num_hidden_layers=30)
    shapes = M.model_shapes(cfg)
    assert shapes["self_attn.k_proj"] == "192x576" and shapes["mlp.down_proj"] == "576x1536"
    true, columns = _synthetic_table(shapes)
    X = _probe_rows(shapes, "BF16", cfg.num_hidden_layers, columns)
    y = [sum(a * true[c] for a, c in zip(row, columns)) for row in X]
    table = {"costs": M.fit_table(X, y, columns)}
    rng = np.random.default_rng(1)
    types = (*M.QUANT_TYPES, "BF16")
    for _ in range(20):  # random mixed-precision models with 10..30 layers
        n = int(rng.integers(10, 31))
        lin = {f"blk.{i}.{k}": f"{types[rng.integers(len(types))]}@{s}" for i in range(n) for k, s in shapes.items()}
        head = "BF16" if rng.random() < 0.5 else "Q8_0"
        want = true[f"fixed@{head}"] + sum(true[v] for v in lin.values())
        assert M.modeled_seconds(table, lin, head) == pytest.approx(want, rel=1e-6)


def test_plan_cost_is_monotone_in_bits(tiny_llama):
    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.space import Arch, build_space

    cfg = NasConfig(bits=[4, 5, 8, 16], group_size=32, target_bits=8.0)
    space = build_space(tiny_llama, cfg)
    shapes = M.model_shapes(tiny_llama.config)
    true, columns = _synthetic_table(shapes, "F32")
    lat, dense = M.measured_latency(tiny_llama, space, {"costs": true}, "F32")
    L, n = space.n_layers, len(space.linears)
    full = len(space.widths) - 1
    costs = [lat.of(space, Arch([True] * L, [full] * L, [[b] * n for _ in range(L)])) for b in range(len(space.bits))]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    assert costs[-1] == pytest.approx(dense)
    # one layer dropped costs less; the MLP width does not change a zero-padded GGUF's time
    drop = lat.of(space, Arch([False] + [True] * (L - 1), [full] * L, [[0] * n for _ in range(L)]))
    assert drop < costs[0]
    assert lat.of(space, Arch([True] * L, [0] * L, [[0] * n for _ in range(L)])) == pytest.approx(costs[0])
    # the expectation under one-hot probabilities equals the exact cost
    import torch

    p_bits = torch.zeros(L, n, len(space.bits))
    p_bits[..., 1] = 1.0
    e = lat.expected(space, torch.ones(L), torch.nn.functional.one_hot(torch.full((L,), full), len(space.widths)).float(), p_bits)
    assert float(e) == pytest.approx(costs[1], rel=1e-5)


def test_table_cache_round_trip_and_key(tmp_path, monkeypatch):
    import transformers

    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path))
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=320, num_hidden_layers=2)
    key = M.table_key(cfg, "BF16", threads=2)
    assert key["cores"] and key["llama_cpp"] and key["machine"] and key["threads"] == 2 and "CPU" in key["build"]
    p = M.cache_path(key)
    assert p.parent == tmp_path / "latency"
    table = {"key": key, "costs": {"fixed@BF16": 1.0}}
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(table))
    assert M.load_cached(key) == table
    other = M.table_key(cfg, "BF16", threads=1)
    assert M.cache_path(other) != p and M.load_cached(other) is None
    p.write_text(json.dumps({**table, "key": other}))  # a file whose key does not match is not used
    assert M.load_cached(key) is None


def test_missing_runtime_exits_2_and_writes_nothing(tmp_path, tiny_hf_dir):
    out = tmp_path / "nas"
    proc = run_without_llama_cpp("nas", str(tiny_hf_dir), "--cost-model", "measured", "--bits", "4,8,16",
                                 "--target-latency", "0.8", "--out", str(out), cwd=tmp_path)
    assert_user_error(proc, "llama-cpp-python", "pip install -e .[runtime]")
    assert not out.exists()
    assert not list(tmp_path.glob("**/latency_table.json"))


def test_bits_without_a_ggml_type_are_refused():
    from llmcompress.errors import UserError
    from llmcompress.nas.config import NasConfig

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (the runtime check comes first)")
    with pytest.raises(UserError, match="3"):
        NasConfig(cost_model="measured", bits=[3, 4, 16], target_bits=4.0).validate()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (pip install -e .[runtime])")
def test_probe_table_of_a_tiny_model_end_to_end(tmp_path, monkeypatch, bpe_tokenizer):  # noqa: F811
    """Probe GGUFs of a tiny model written, run in llama.cpp and fitted; the table predicts a real export."""
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    from llmcompress.export.api import ExportOptions, quantize_for_export
    from llmcompress.export.gguf import write_gguf

    model = _tiny(len(bpe_tokenizer), layers=2)
    table = M.measure_table(model.config, bpe_tokenizer, ftype="F32", threads=1, layers=4, repeats=2, progress=False,
                            quant_types=("Q4_0", "Q8_0"))
    shapes = set(M.model_shapes(model.config).values())
    assert {f"Q4_0@{s}" for s in shapes} <= set(table["costs"]) and "fixed@F32" in table["costs"]
    assert all(v >= 0 for v in table["costs"].values())
    assert len(table["probes"]) == len(M.probe_plans(M.model_shapes(model.config), "F32", 4, ("Q4_0", "Q8_0")))
    assert table["key"]["probe_layers"] == 4 and {p["name"]: len(p["samples"]) for p in table["probes"]}["base-half"] == 2
    assert all(p["seconds"] > 0 and len(p["samples"]) == 2 for p in table["probes"])
    assert M.cache_path(table["key"]).is_file()
    assert M.load_cached(table["key"]) == json.loads(M.cache_path(table["key"]).read_text())
    qweights, _ = quantize_for_export(model, bpe_tokenizer, "gguf", ExportOptions(bits=4, group_size=32, sym=True), progress=False)
    path = write_gguf(model, tmp_path / "m.gguf", qweights=qweights, float_dtype="float32", tokenizer=bpe_tokenizer)["path"]
    lin, head, layers = M.gguf_columns(path)
    assert layers == 2 and head == "Q8_0" and set(lin.values()) <= {f"Q4_0@{s}" for s in shapes}
    assert M.modeled_gguf(table, path) > 0 and M.measure_gguf(path, threads=1, repeats=2) > 0
    # a probe file holds the (type, shape) columns its plan says (measure_table counts them from the plans)
    shapes_of = M.model_shapes(model.config)
    _name, kinds, head, n = M.probe_plans(shapes_of, "F32", 2, ("Q4_0", "Q8_0"))[2]
    probe = M._probe_model(model.config, n)
    from llmcompress.export.api import quantize_embeddings_

    emb_q = quantize_embeddings_(probe)["model.embed_tokens"]
    M.write_probe(probe, bpe_tokenizer, tmp_path / "p.gguf", kinds, head, "F32", emb_q)
    lin, h, layers = M.gguf_columns(tmp_path / "p.gguf")
    assert (h, layers) == (head, n)
    assert sorted(lin.values()) == sorted(f"{t}@{shapes_of[k]}" for i in range(n) for k, t in kinds.items())
    assert {v.split("@")[0] for v in lin.values()} == {"Q4_0", "Q8_0"}  # the plan's mix, not one type
