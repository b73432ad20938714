"""`nas --cost-model measured`: per-token decode latency in llama.cpp, from a table measured on this machine.

The table: the decode time (seconds per token, batch 1) of one linear layer of each model shape stored as
each ggml tensor type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the float type of the source, BF16 for
smollm2-135m), plus a fixed part per output-matrix type (token embedding lookup, final norm, output head,
sampling overhead). A GGUF's modeled time is

    t = fixed[type of the output matrix] + sum over decoder linears cost[type][shape]

(the per-layer work outside the linears -- norms, rope, attention over the KV cache -- cannot be told apart
from the linears, since every layer has each shape once: it is shared among the shape costs, which changes
no prediction for a model made of whole layers).

How it is measured: probe GGUFs (`probe_layers` decoder layers of the model's shapes -- by default as many
as the model has --, its vocabulary, random weights quantized by RTN, written by
`llmcompress.export.gguf.write_gguf`), one base probe (every linear Q8_0) and one with half its layers
(which tells the per-layer time from the fixed part), one per (type, shape group) with that group's
linears in that type, one per uniform type and one with a float output matrix. Probes as deep as the
model matter: with 4-layer probes (version 1) the weights stayed in cache, every probe decoded in ~2 ms
whatever its types, and the table underestimated full-depth decode by 14-39%, most for the widest types
(smollm2-135m, 2026-12-06: MAPE 26%, Spearman 0.73), since a full model streams its weights from memory;
full-depth probes: MAPE 3.6%, Spearman 0.94 on the same 15 exports (bench/bench_costmodel.py). Each is run in llama-cpp-python (`n_threads` = cores,
OpenMP wait policy as `OMP_WAIT_POLICY` was when llama_cpp was first imported -- libgomp reads it once, at load,
so setting it later does nothing; unset is libgomp's default, spin then sleep, the fastest on idle cores; set
PASSIVE on a shared machine -- recorded in the table's key): a short prompt, then tokens decoded one at a time; the runs are
interleaved across probes (round r times every probe once, in a rotated order), so drifting load hits all
alike, and each probe's time is the fastest of `repeats` (7) rounds after a warm-up round (`stat`; on a
shared machine the rounds are bimodal, quiet or 2-3x slower, so the median is whichever mode dominated;
the median is recorded next to it). Costs are fitted by
non-negative least squares (scipy.optimize.nnls when scipy is installed, else a projected-gradient
fallback in numpy) on the probes' counts of (type, shape) linears.

The table is cached as JSON under `llmcompress.paths.cache_dir()/latency/`, keyed by the CPU model,
core count, llama-cpp-python version and build features, thread count, protocol and the model's shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from llmcompress.errors import UserError
from llmcompress.export.gguf import FLOAT_TYPES, GGML_TYPES, ggml_type_name
from llmcompress.runtime import cpu_model, load_average

QUANT_TYPES = tuple(GGML_TYPES.values())
TYPE_BITS = {t: bits_sym for bits_sym, t in GGML_TYPES.items()}  # ggml type -> (bits, symmetric)
BASE = "Q8_0"
PROBE_LAYERS = 0  # 0: the model's own depth (see the module docstring)
PROMPT, DECODE, REPEATS = 32, 32, 7
STAT = "min"  # of the interleaved rounds: on shared cores the runs are bimodal (quiet, or 2-3x slower while
# another job holds a core; measured at load 11 on 2 cores), and the fastest is the least disturbed, as for `lut`
VERSION = 2  # 2: full-depth probes, a half-depth base (1: 4 and 8 layers)
KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def require_runtime():
    """llama_cpp, or the one-line UserError naming the extra (`pip install -e .[runtime]`)."""
    try:
        import llama_cpp
    except ImportError:
        from llmcompress.eval.llamacpp import INSTALL_HINT

        raise UserError("--cost-model measured times GGUF probes in llama.cpp, and llama-cpp-python is not installed",
                        INSTALL_HINT) from None
    return llama_cpp


def float_type(dtype: str) -> str:
    return FLOAT_TYPES[dtype]


def shape_key(out: int, inp: int) -> str:
    return f"{out}x{inp}"


def model_shapes(cfg) -> dict[str, str]:
    """Linear kind -> shape key of a LLaMA-style config."""
    h = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv, ffn = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shp = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
           "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h), "mlp.down_proj": (h, ffn)}
    return {k: shape_key(*v) for k, v in shp.items()}


# ------------------------------------------------------------------------------------------ fit
def nnls(X, y):
    """argmin ||X c - y|| subject to c >= 0."""
    import numpy as np

    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    try:
        from scipy.optimize import nnls as _nnls

        return _nnls(X, y, maxiter=50 * X.shape[1])[0]
    except ImportError:  # projected gradient on the normal equations (slow, exact enough for these sizes)
        G, b = X.T @ X, X.T @ y
        step = 1.0 / max(np.linalg.eigvalsh(G).max(), 1e-30)
        c = np.clip(np.linalg.lstsq(X, y, rcond=None)[0], 0, None)
        for _ in range(20000):
            c = np.clip(c - step * (G @ c - b), 0, None)
        return c


def features(types: dict[str, str], head: str, columns: list[str]) -> list[float]:
    """Counts of each column ("TYPE@SHAPE" per decoder linear, "fixed@TYPE" once) for one GGUF.
    `types`: tensor name -> "TYPE@SHAPE" of its decoder linears."""
    row = [0.0] * len(columns)
    idx = {c: i for i, c in enumerate(columns)}
    for col in types.values():
        if col not in idx:
            raise KeyError(col)
        row[idx[col]] += 1
    row[idx[f"fixed@{head}"]] += 1
    return row


def fit_table(rows: list[list[float]], seconds: list[float], columns: list[str]) -> dict[str, float]:
    """Non-negative per-column costs (seconds per token) from probe counts and times."""
    c = nnls(rows, seconds)
    return {col: float(v) for col, v in zip(columns, c)}


# ------------------------------------------------------------------------------------------ probes
def probe_plans(shapes: dict[str, str], ftype: str, layers: int = PROBE_LAYERS, quant_types=QUANT_TYPES) -> list[tuple[str, dict[str, str], str, int]]:
    """(name, linear kind -> type, output-matrix type, decoder layers) of every probe. All have `layers`
    layers but one base probe with half as many, which tells the per-layer time from the fixed part."""
    groups: dict[str, list[str]] = {}
    for kind, s in shapes.items():
        groups.setdefault(s, []).append(kind)
    types = (*quant_types, ftype)
    plans = [("base", {k: BASE for k in shapes}, BASE, layers), ("base-half", {k: BASE for k in shapes}, BASE, max(1, layers // 2))]
    for t in types:
        if t != BASE:
            for s, kinds in groups.items():
                plans.append((f"{t}@{s}", {k: (t if k in kinds else BASE) for k in shapes}, BASE, layers))
            plans.append((f"uniform-{t}", {k: t for k in shapes}, BASE if t in TYPE_BITS else ftype, layers))
    plans.append((f"head-{ftype}", {k: BASE for k in shapes}, ftype, layers))
    return plans


def _probe_model(cfg, layers: int, seed: int = 0):
    import copy

    import torch
    import transformers

    c = copy.deepcopy(cfg)
    c.num_hidden_layers = layers
    if hasattr(c, "layer_types") and c.layer_types is not None:
        c.layer_types = c.layer_types[:layers]
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32).eval()


def _first_layers(model, n: int):
    """A view of `model` with its first `n` decoder layers (weights shared)."""
    from llmcompress.io.surgery import shared_copy

    if n == len(model.model.layers):
        return model
    m = shared_copy(model)
    m.model.layers = m.model.layers[:n]
    m.config.num_hidden_layers = n
    return m


def write_probe(model, tokenizer, path: Path, kinds: dict[str, str], head: str, ftype: str, head_q=None) -> Path:
    """One probe GGUF: each decoder linear of `kinds`' type, the output matrix (tied embedding) `head`."""
    from llmcompress.export.gguf import write_gguf
    from llmcompress.quant import primitives as P
    from llmcompress.quant.apply import QuantizedWeight

    qweights = {}
    for i, layer in enumerate(model.model.layers):
        mods = dict(layer.named_modules())
        for kind, t in kinds.items():
            if t in TYPE_BITS:
                bits, sym = TYPE_BITS[t]
                q, s, z = P.quantize(mods[kind].weight.data, bits, 32, sym=sym)
                qweights[f"model.layers.{i}.{kind}"] = QuantizedWeight(q, s, z, bits, 32, sym)
    if head in TYPE_BITS:
        qweights["model.embed_tokens"] = head_q
        if not getattr(model.config, "tie_word_embeddings", False):
            qweights["lm_head"] = head_q
    dtype = {t: d for d, t in FLOAT_TYPES.items()}[ftype]
    write_gguf(model, path, qweights=qweights, float_dtype=dtype, tokenizer=tokenizer, name="llmcompress latency probe",
               overwrite=True)
    return path


def gguf_columns(path: Path, shapes: set[str] | None = None) -> tuple[dict[str, str], str, int]:
    """(decoder linear tensor name -> "TYPE@SHAPE", output-matrix type, layer count) of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(str(path))
    lin, head, emb, layers = {}, None, None, set()
    for t in r.tensors:
        name, tname = t.name, t.tensor_type.name
        if name.startswith("blk.") and len(t.shape) == 2:
            ne = [int(x) for x in t.shape]  # ggml order: (in, out)
            lin[name] = f"{tname}@{shape_key(ne[1], ne[0])}"
            layers.add(int(name.split(".")[1]))
        elif name == "output.weight":
            head = tname
        elif name == "token_embd.weight":
            emb = tname
    return lin, head or emb, len(layers)


def time_decode(llms: dict, *, prompt: int = PROMPT, decode: int = DECODE, repeats: int = REPEATS, progress: bool = True) -> dict[str, list[float]]:
    """Seconds per decoded token of every open llama_cpp.Llama in `llms`, `repeats` samples each (after a
    warm-up round), interleaved: each round runs every model once, in an order rotated per round."""
    import numpy as np

    names = list(llms)
    vocab = min(llm.n_vocab() for llm in llms.values())
    ids = np.random.default_rng(0).integers(min(10, vocab - 1), vocab, prompt + decode).tolist()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats + 1):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            llm = llms[n]
            llm.reset()
            llm.eval(ids[:prompt])
            t0 = time.perf_counter()
            for tok in ids[prompt:]:
                llm.eval([tok])
            dt = (time.perf_counter() - t0) / decode
            if r:
                out[n].append(dt)
        if progress:
            import sys

            print(f"latency probes: round {r + 1}/{repeats + 1} done", file=sys.stderr, flush=True)
    return out


def open_llms(paths: dict[str, Path], threads: int, n_ctx: int) -> dict:
    from llmcompress.eval.llamacpp import open_gguf

    return {n: open_gguf(p, n_ctx=n_ctx, threads=threads) for n, p in paths.items()}


# ------------------------------------------------------------------------------------------ table
def summarize(samples: list[float], stat: str = STAT) -> float:
    return min(samples) if stat == "min" else statistics.median(samples)


def table_key(cfg, ftype: str, threads: int, layers: int = PROBE_LAYERS, stat: str = STAT, repeats: int = REPEATS) -> dict:
    import llama_cpp

    from llmcompress.eval.llamacpp import system_info

    return {"machine": cpu_model(), "cores": os.cpu_count(), "threads": threads, "llama_cpp": llama_cpp.__version__,
            "build": system_info(),  # two builds of one version can run a GGUF through different kernels
            "shapes": sorted(set(model_shapes(cfg).values())), "vocab": int(cfg.vocab_size), "float": ftype,
            "tied": bool(getattr(cfg, "tie_word_embeddings", False)), "probe_layers": layers,
            "protocol": f"prompt {PROMPT}, decode {DECODE}, {stat} of {repeats} interleaved rounds", "version": VERSION,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}


def cache_path(key: dict) -> Path:
    from llmcompress.paths import cache_dir

    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "latency" / f"llamacpp-{h}.json"


def load_cached(key: dict) -> dict | None:
    p = cache_path(key)
    try:
        t = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return t if t.get("key") == key else None


def measure_table(cfg, tokenizer, *, ftype: str = "BF16", threads: int | None = None, layers: int = PROBE_LAYERS,
                  repeats: int = REPEATS, use_cache: bool = True, progress: bool = True, quant_types=QUANT_TYPES,
                  stat: str = STAT) -> dict:
    """The latency table of `cfg`'s shapes on this machine (cached; see the module docstring)."""
    require_runtime()
    from llmcompress.export.api import EMBED_BITS, EMBED_GROUP
    from llmcompress.io.atomic import write_json
    from llmcompress.quant import primitives as P
    from llmcompress.quant.apply import QuantizedWeight
    from llmcompress.runtime import default_threads

    threads = threads or default_threads()
    layers = layers or int(cfg.num_hidden_layers)
    key = {**table_key(cfg, ftype, threads, layers, stat, repeats), "types": [*quant_types, ftype]}
    if use_cache and (hit := load_cached(key)) is not None:
        return hit
    t_start = time.time()
    model = _probe_model(cfg, layers)
    emb = model.get_input_embeddings().weight.data
    q, s, z = P.quantize(emb, EMBED_BITS, EMBED_GROUP, sym=True)
    head_q = QuantizedWeight(q, s, z, EMBED_BITS, EMBED_GROUP, True)
    plans = probe_plans(model_shapes(cfg), ftype, layers, quant_types)
    with tempfile.TemporaryDirectory(prefix="llmcompress-probes-") as tmp:
        paths = {name: write_probe(_first_layers(model, n), tokenizer, Path(tmp) / f"{i}.gguf", kinds, head, ftype, head_q)
                 for i, (name, kinds, head, n) in enumerate(plans)}
        shapes = model_shapes(cfg)  # the probes' columns follow from their plans (reading 28 files back takes minutes)
        cols = {name: ({f"blk.{i}.{k}": f"{t}@{shapes[k]}" for i in range(n) for k, t in kinds.items()}, head, n)
                for name, kinds, head, n in plans}
        llms = open_llms(paths, threads, PROMPT + DECODE)
        try:
            samples = time_decode(llms, repeats=repeats, progress=progress)
        finally:
            for llm in llms.values():
                llm.close()
    columns = sorted({c for lin, _, _ in cols.values() for c in lin.values()}) + sorted({f"fixed@{h}" for _, h, _ in cols.values()})
    X = [features(cols[n][0], cols[n][1], columns) for n in paths]
    y = [summarize(samples[n], stat) for n in paths]
    costs = fit_table(X, y, columns)
    pred = [sum(c * costs[col] for c, col in zip(row, columns)) for row in X]
    table = {"key": key, "costs": costs, "columns": columns,
             "probes": [{"name": n, "seconds": y[i], "median": statistics.median(samples[n]), "samples": samples[n],
                         "modeled": pred[i]} for i, n in enumerate(paths)],
             "fit_mape": statistics.mean(abs(p / t - 1) for p, t in zip(pred, y)),
             "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "seconds_taken": time.time() - t_start,
             "load_average": load_average()}
    write_json(cache_path(key), table)
    return table



def modeled_seconds(table: dict, types: dict[str, str], head: str) -> float:
    """Modeled seconds per decoded token of a GGUF with decoder linears `types` (name -> "TYPE@SHAPE")."""
    c = table["costs"]
    missing = sorted({v for v in types.values() if v not in c} | ({f"fixed@{head}"} - set(c)))
    if missing:
        raise UserError(f"the latency table has no entry for {', '.join(missing)}",
                        "the measured cost model covers Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the source's float type")
    return c[f"fixed@{head}"] + sum(c[v] for v in types.values())


def modeled_gguf(table: dict, path: Path) -> float:
    lin, head, _ = gguf_columns(path)
    return modeled_seconds(table, lin, head)


def measure_gguf(path: Path, *, threads: int | None = None, repeats: int = REPEATS, stat: str = STAT) -> float:
    """Measured seconds per decoded token of one GGUF (the table's protocol)."""
    from llmcompress.runtime import default_threads

    require_runtime()
    llms = open_llms({"m": Path(path)}, threads or default_threads(), PROMPT + DECODE)
    try:
        return summarize(time_decode(llms, repeats=repeats, progress=False)["m"], stat)
    finally:
        llms["m"].close()


# ------------------------------------------------------------------------------------------ nas
def bits_type(bits: int, ftype: str = "BF16") -> str:
    """The ggml type a `nas` GGUF export gives a linear of `bits` (asymmetric below 8 bits; 8 -> Q8_0)."""
    return ftype if bits >= 16 else ggml_type_name(bits, sym=bits == 8)


def measured_latency(model, space, table: dict, ftype: str):
    """(Additive latency in seconds per token, dense float model's seconds) for `nas`' cost framework: a
    per-(linear, bits) term, independent of the MLP width (GGUF exports zero-pad MLPs to the dense width),
    and `fixed` = the float output matrix (nas keeps embeddings in the source dtype)."""
    from llmcompress.nas.cost import Additive

    shapes = model_shapes(model.config)
    c = table["costs"]
    C = {}
    for lin in space.linears:
        C[lin] = [modeled_seconds(table, {lin: f"{bits_type(b, ftype=ftype)}@{shapes[lin]}"}, ftype) - c[f"fixed@{ftype}"]
                  for b in space.bits]
    zeros = {n: [0.0] * len(space.widths) for n in space.linears}
    H = None
    if space.head_bits:  # a searched head: the fixed part of its output-matrix type, where the table has one
        from llmcompress.errors import UserError

        types = [bits_type(b, ftype=ftype) for b in space.head_bits]
        missing = sorted({t for t in types if f"fixed@{t}" not in c})
        if missing:
            have = sorted(k.split("@", 1)[1] for k in c if k.startswith("fixed@"))
            raise UserError(f"the llama.cpp latency table has no output-matrix probe of type {', '.join(missing)}",
                            f"use head_bits whose types it has ({', '.join(have)}), or --cost-model analytic")
        H = [c[f"fixed@{t}"] for t in types]
    lat = Additive(0.0 if H else c[f"fixed@{ftype}"], 0.0, zeros, [0.0] * len(space.bits), C=C, H=H)
    dense = c[f"fixed@{ftype}"] + space.n_layers * sum(c[f"{ftype}@{shapes[n]}"] for n in space.linears)
    return lat, dense


__all__ = ["fit_table", "measure_gguf", "measure_table", "measured_latency", "modeled_gguf", "modeled_seconds", "nnls",
           "probe_plans", "require_runtime"]
