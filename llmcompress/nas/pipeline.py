"""Orchestration of `llmcompress nas`: load, rank channels, cost models, search, derive, export, evaluate."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from llmcompress.nas.config import NasConfig

log = logging.getLogger("llmcompress")

STALE = ("search_log.jsonl", "lut.json", "latency_table.json", "search_state_*.json", "search_state_*.safetensors", "search_state_*.pt", "refine_*.json")  # removed by --overwrite (io/rundir.py)


@dataclass
class NasRun:
    out_dir: Path
    arch: dict
    rows: list[dict] = field(default_factory=list)


def search_blocks(tokenizer, cfg: NasConfig):
    """The search's calibration blocks, and disjoint held-out blocks for the refinement (None when the
    data holds no more)."""
    from llmcompress.data import calibration_blocks
    from llmcompress.errors import DataError

    n = cfg.steps * cfg.batch_size
    kw = dict(source=cfg.calib_source, split=cfg.calib_split, seq_len=cfg.seq_len, seed=cfg.seed)
    blocks, _ = calibration_blocks(tokenizer, n_blocks=n, **kw)
    if cfg.calib_source == "self":  # sampled text: another seed gives other blocks (offset does not apply)
        kw["seed"] = cfg.seed + 1
    try:
        held_out, _ = calibration_blocks(tokenizer, n_blocks=cfg.refine_blocks, offset=len(blocks), **kw)
    except DataError:  # the data is used up by the search: no refinement
        held_out = None
    return blocks, held_out


def evaluate(model, tokenizer, cfg: NasConfig) -> dict:
    """A result's post-run measures: WikiText-2 perplexity `ppl/wikitext2` through `eval.report.measure_noted`
    (missing data becomes a line under `notes`), and measured speed."""
    from llmcompress.eval.report import NOTES, WIKITEXT2_PPL, measure_noted, wikitext2_spec

    out = {}
    if cfg.eval_tokens > 0:
        row = measure_noted(model, tokenizer, wikitext2_spec(cfg.eval_tokens, cfg.eval_seq_len))
        out.update({k: row[k] for k in (WIKITEXT2_PPL, NOTES) if k in row})
    if cfg.measure_speed:
        from llmcompress.eval.speed import measure_speed

        s = measure_speed(model, prompt_len=128, decode_tokens=16, repeats=2)
        out.update(prefill_tokens_per_s=s["prefill_tokens_per_s"], decode_tokens_per_s=s["decode_tokens_per_s"])
    return out


def _row(name, space, result, extra) -> dict:
    arch = result.arch
    widths = [space.widths[w] for w, k in zip(arch.width, arch.keep) if k]
    return {"name": name, "layers": sum(arch.keep), "mean_width": sum(widths) / max(len(widths), 1),
            "avg_bits": result.metrics["bits"], "size_mb": result.metrics["size_mb"],
            "modeled_latency": result.metrics["latency"], **extra}


def _cost_models(model, space, cfg, out: Path, resume: bool, tokenizer=None, float_dtype: str = "bfloat16"):
    """The cost models (a measured LUT is reused on --resume; the caller saves it once the data has loaded;
    the llama.cpp table of `measured` is cached by nas/measured.py)."""
    from llmcompress.nas.cost import build_cost_models

    lut_path = out / "lut.json"
    lut = json.loads(lut_path.read_text()) if (resume and cfg.cost_model == "lut" and lut_path.is_file()) else None
    return build_cost_models(model, space, cfg.cost_model, cfg.context_len, lut, tokenizer=tokenizer, float_dtype=float_dtype)


def _runtime_check(gguf_path: Path, costs, arch) -> dict:
    """Modeled (the measured table) vs measured (llama.cpp) seconds per decoded token of the exported GGUF."""
    from llmcompress.nas import measured as M
    from llmcompress.runtime import load_average

    modeled = costs.latency.of(costs.space, arch)
    from_file = M.modeled_gguf(costs.table, gguf_path)
    got = M.measure_gguf(gguf_path)
    return {"modeled_ms_per_token": modeled * 1e3, "modeled_from_file_ms_per_token": from_file * 1e3,
            "measured_ms_per_token": got * 1e3, "error": modeled / got - 1, "load_average": load_average(),
            "protocol": costs.table["key"]["protocol"]}


def run_nas(cfg: NasConfig, out: Path, *, overwrite: bool = False, resume: bool = False, device: str = "cpu", dtype=None) -> NasRun:
    """Run the search of `cfg.mode` (+ `cfg.baselines`) and write everything under `out`, with the model
    loaded on `device` in `dtype` (None: float32; the CLI resolves --device/--dtype)."""
    import torch

    from llmcompress.io.atomic import write_json
    from llmcompress.io.checkpoint import build_manifest
    from llmcompress.io.load import load_model
    from llmcompress.io.rundir import claim
    from llmcompress.io.stream import check_fits
    from llmcompress.nas import export as E
    from llmcompress.nas import search as S
    from llmcompress.nas.report import write_report
    from llmcompress.nas.space import build_space, mlp_channel_importance, permute_mlp_
    from llmcompress.runtime import resolve_device, seed_everything

    out = Path(out)
    cfg.validate()
    dev, _ = resolve_device(device)
    check_fits(cfg.model, dtype or torch.float32, dev, what="the nas supernet")  # before --out is claimed
    claim(out, overwrite=overwrite, resume=resume, stale=STALE).start()
    seed_everything(cfg.seed)
    lm = load_model(cfg.model, device=dev, dtype=dtype)
    teacher, tok = lm.model, lm.tokenizer
    space = build_space(teacher, cfg)
    if "gguf" in cfg.export and space.group_size % 32:
        from llmcompress.errors import UserError

        raise UserError(f"--export gguf needs a group size divisible by 32; the search uses {space.group_size}",
                        "pass --group-size 32 or 64")
    from llmcompress.io.dtypes import save_dtype_for

    save_dtype = save_dtype_for(lm, cfg.save_dtype)
    sym8 = "gguf" in cfg.export
    costs = _cost_models(teacher, space, cfg, out, resume, tok, save_dtype)
    S.check_reachable(costs, cfg)
    blocks, held_out = search_blocks(tok, cfg)  # bad data fails here, before anything is written to --out
    blocks, held_out = blocks.to(dev), (held_out.to(dev) if held_out is not None else None)
    if costs.lut is not None:
        write_json(out / "lut.json", costs.lut)
    if costs.table is not None:
        write_json(out / "latency_table.json", costs.table)
    imp = mlp_channel_importance(teacher, blocks[: min(8, len(blocks))])
    permute_mlp_(teacher, [i.argsort(descending=True, stable=True) for i in imp])
    # one quantizer for the whole run: the supernet, the sensitivities, the validated step and the export
    # all read these weights (nas/qbank.py), whatever the mode
    bank = S.bank_for(teacher, space, cfg, blocks)

    rows = [{"name": "dense (float32)", "layers": space.n_layers, "mean_width": space.intermediate, "avg_bits": 16.0,
             "size_mb": sum(p.numel() for p in teacher.parameters()) * 2 / 1e6, "modeled_latency": 1.0,
             **evaluate(teacher, tok, cfg)}]
    notes: list[str] = []
    modes = [cfg.mode] + [m for m in cfg.baselines if m != cfg.mode]
    primary = None
    summaries = {}
    method = cfg.quant_method
    for mode in modes:
        if mode == "joint":
            res = S.search_joint(teacher, space, costs, cfg, blocks, out, resume, held_out, bank=bank)
        elif mode == "sequential":
            res = S.search_sequential(teacher, space, costs, cfg, blocks, out, resume, held_out, bank=bank)
        else:
            res = S.search_uniform(space, costs, cfg)
        if res.note:
            notes.append(f"{mode}: {res.note}")
        model = E.derive_model(teacher, space, res.arch)
        plan = E.plan_of(space, res.arch, sym8, method)
        qweights = E.apply_bank(model, space, res.arch, bank)
        evals = evaluate(model, tok, cfg)
        row = _row(f"{mode} ({method.upper()})", space, res, evals)
        rows.append(row)
        summary = {"mode": mode, "quant_method": method, "avg_bits": res.metrics["bits"], "modeled_latency": res.metrics["latency"],
                   "size_mb": res.metrics["size_mb"], "metrics": evals, "architecture": res.arch.to_dict(space),
                   "plan": plan.to_dict(), "refine": res.refine}
        summaries[mode] = summary
        if mode == cfg.mode:
            manifest = build_manifest(source=cfg.model, source_hash=lm.source_hash, method=f"nas-{mode}/{method}", config=cfg.to_dict(),
                                      metrics={**evals, **res.metrics}, extra={"plan": plan.to_dict()})
            E.save_hf(model, tok, out / "hf", manifest, space.intermediate, overwrite=True, dtype=save_dtype)
            from llmcompress.eval.speed import disk_bytes

            summary["hf_disk_mb"] = disk_bytes(out / "hf") / 1e6
            summary["hf_dtype"] = save_dtype
            exports = E.save_exports(model, tok, qweights, out, cfg.export, space.intermediate, save_dtype, manifest)
            summary["exports"] = {f: {"path": r["path"], "bytes": r["bytes"], **({"note": r["note"]} if "note" in r else {})}
                                  for f, r in exports.items()}
            notes += [f"{f}: {r['note']}" for f, r in exports.items() if "note" in r]
            if "gguf" in exports and costs.table is not None:
                summary["runtime_latency"] = rt = _runtime_check(Path(exports["gguf"]["path"]), costs, res.arch)
                notes.append(f"gguf in llama.cpp: modeled {rt['modeled_ms_per_token']:.2f} ms/token, measured "
                             f"{rt['measured_ms_per_token']:.2f} ms/token ({rt['error']:+.1%}; {rt['protocol']}, load {rt['load_average']})")
            primary = summary
        else:
            write_json(out / "baselines" / f"{mode}.json", summary)
        del model, qweights
    if costs.table is not None:
        t = costs.table
        notes.insert(0, f"latency table (measured cost model): {len(t['probes'])} probe GGUFs timed in llama.cpp "
                        f"{t['measured_at']} ({t['key']['machine']}, {t['key']['threads']} threads, load {t['load_average']}), "
                        f"fit error {t['fit_mape']:.1%} on the probes; dense float model modeled at {costs.latency_dense * 1e3:.2f} ms/token")
    arch = {**primary, "cost_model": cfg.cost_model, "targets": cfg.targets(), "group_size": space.group_size,
            "bits_choices": space.bits, "head_bits_choices": space.head_bits, "mlp_widths_choices": space.widths, "config": cfg.to_dict(),
            "baselines": {m: {k: v for k, v in s.items() if k not in ("plan",)} for m, s in summaries.items() if m != cfg.mode},
            "dense": rows[0]}
    write_json(out / "arch.json", arch)
    from llmcompress.eval.report import NOTES

    notes += list(dict.fromkeys(n for r in rows for n in r.get(NOTES, ())))  # a missing corpus: said once, not per row
    write_report(out / "report.md", rows, cfg, costs.lut, notes)
    return NasRun(out, arch, rows)
