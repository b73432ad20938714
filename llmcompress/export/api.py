"""`export_model`: load any model llmcompress reads, quantize it (RTN or GPTQ, uniform bits or a `nas`
plan) and write it as GGUF or compressed-tensors. `quantize_for_export` is the quantization step alone.

GPTQ is calibrated as `nas` calibrates it: `NasConfig`'s defaults (calibration source and split, block
length, number of blocks, act-order), through the same `calibration_blocks` and `gptq_model_`.

What is quantized:
* the decoder's linear layers (q/k/v/o, gate/up/down): `bits` with `group_size`, symmetric or not;
  8 bits are symmetric unless asked otherwise (`--bits 8` alone is Q8_0-style);
* for GGUF, the token embedding (and an untied output matrix) as symmetric 8-bit groups of 32 (Q8_0),
  as llama.cpp's own Q4 files do and as the GGUF smollm2-135m ships in, or `embed_bits` 4 (Q4_0) / 16
  (source dtype); compressed-tensors keeps them in the source dtype (vLLM's pack-quantized kernels cover
  linear layers only);
* `--bits 16`: nothing; every tensor is written in the source dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcompress.dist import DistInfo, world
from llmcompress.errors import UserError

if TYPE_CHECKING:
    from llmcompress.quant.apply import QuantizedWeight
    from llmcompress.quant.plan import MixedPrecisionPlan

FORMATS = ("gguf", "compressed-tensors")
DECODER_LINEARS = r"re:.*\.layers\.\d+\..*"
EMBED_BITS, EMBED_GROUP = 8, 32
EMBED_CHOICES = (4, 8, 16)  # GGUF embedding / output matrix: Q4_0, Q8_0, source dtype


@dataclass
class ExportOptions:
    """How to quantize and write (defaults owned here; the CLI passes only what the user set).

    bits: 4 | 5 | 8 | 16 for every decoder linear (16 = no quantization); ignored when `plan` is given.
    quant: rtn | gptq. group_size: 32 | 64 | 128 (0 = 32 for GGUF, whose blocks are 32 wide; 128 for
    compressed-tensors). sym: None = asymmetric below 8 bits, symmetric at 8.
    plan: a `nas` arch.json (its "plan") or a MixedPrecisionPlan dict: per-linear bits.
    save_dtype: dtype of unquantized tensors (None = the source model's dtype).
    embed_bits: GGUF only: the token embedding and output matrix as 8 (Q8_0) | 4 (Q4_0) symmetric groups of
    32, or 16 (source dtype). None = 8 when any linear is quantized, else 16.
    separate_output: GGUF only: a tied output matrix also written as its own `output.weight`, which llama.cpp
    repacks for its fast CPU matmul (a tied `token_embd` is not repacked); costs a second copy. With
    `quant="gptq"` and `embed_bits` < 16, the output matrix is untied and gets its own GPTQ integers
    (calibrated on the final hidden states) while the embedding keeps RTN's.
    """

    bits: int = 4
    quant: str = "rtn"
    group_size: int = 0
    sym: bool | None = None
    plan: Path | None = None
    save_dtype: str | None = None
    calib_source: str | None = None
    calib_blocks: int | None = None
    seed: int = 0
    embed_bits: int | None = None
    separate_output: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, to: str) -> None:
        from llmcompress import spec

        if to not in FORMATS:
            raise UserError(f"unknown export format {to!r}", f"use --to {' or --to '.join(FORMATS)}")
        spec.check_ranges(self, RANGES)
        if self.plan is None and self.bits not in (4, 5, 8, 16):
            raise UserError(f"--bits {self.bits} is not supported", "use 4, 5, 8 or 16")
        if self.quant not in ("rtn", "gptq"):
            raise UserError(f"unknown --quant {self.quant!r}", "use rtn or gptq")
        if self.group_size not in (0, 32, 64, 128):
            raise UserError(f"--group-size {self.group_size} is not supported", "use 32, 64 or 128")
        if self.save_dtype not in (None, "float32", "bfloat16", "float16"):
            raise UserError(f"unknown --save-dtype {self.save_dtype!r}", "use float32, bfloat16 or float16")
        if self.embed_bits is not None and self.embed_bits not in EMBED_CHOICES:
            raise UserError(f"--embed-bits {self.embed_bits} is not supported", "use 4 (Q4_0), 8 (Q8_0) or 16 (no quantization)")
        if self.embed_bits is not None and to != "gguf":
            raise UserError("--embed-bits applies to --to gguf", "compressed-tensors keeps embeddings in the source dtype")
        if self.separate_output and to != "gguf":
            raise UserError("--separate-output applies to --to gguf", "compressed-tensors keeps the model's own tying")
        if self.plan is not None and not Path(self.plan).is_file():
            raise UserError(f"plan file {self.plan} not found", "pass the arch.json a `llmcompress nas` run wrote")

    def group_for(self, to: str) -> int:
        return self.group_size or (32 if to == "gguf" else 128)


def _ranges():
    from llmcompress.spec import MAX_COUNT, MAX_SEED, MAX_SEQ, Int

    return {
        "bits": Int("--bits", 2, 16, note="use 4, 5, 8 or 16"),
        "group_size": Int("--group-size", 0, MAX_SEQ, note="use 32, 64 or 128 (0: 32 for gguf, 128 for compressed-tensors)"),
        "embed_bits": Int("--embed-bits", 4, 16, note="use 4, 8 or 16"),
        "calib_blocks": Int("calib_blocks", 1, MAX_COUNT),
        "seed": Int("--seed", 0, MAX_SEED),
    }


RANGES = _ranges()  # checked by ExportOptions.validate before any model loads, like every engine's config


def load_plan(path: Path) -> MixedPrecisionPlan:
    """The MixedPrecisionPlan of a nas arch.json (key "plan") or of a plan dict file."""
    from llmcompress.quant.plan import MixedPrecisionPlan

    try:
        d = json.loads(Path(path).read_text())
        return MixedPrecisionPlan.from_dict(d.get("plan", d))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{path} holds no quantization plan ({type(exc).__name__}: {exc})",
                        "pass the arch.json a `llmcompress nas` run wrote") from None


def export_plan(model, to: str, opts: ExportOptions) -> tuple[MixedPrecisionPlan, list[str]]:
    """The plan applied to `model` (every entry adjusted to what `to` can store) and notes on changes."""
    from llmcompress.quant.apply import linear_fqns
    from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

    notes: list[str] = []
    group = opts.group_for(to)
    if opts.plan is None:
        plan = MixedPrecisionPlan()
        if opts.bits < 16:
            plan[DECODER_LINEARS] = QuantConfig(bits=opts.bits, group_size=group, method=opts.quant,
                                                sym=opts.sym if opts.sym is not None else opts.bits == 8)
        plan["_default"] = None
        return plan, notes
    src = load_plan(opts.plan)
    plan = MixedPrecisionPlan()
    names = [f for f in linear_fqns(model) if f != "lm_head"]
    for fqn, cfg in src.quantized(names).items():
        if cfg.bits >= 16:
            continue
        sym = opts.sym if opts.sym is not None else (cfg.sym or cfg.bits == 8)
        if to == "gguf" and cfg.bits == 8 and not sym:
            sym = True
        if sym != cfg.sym:
            notes.append(f"{fqn}: {cfg.bits}-bit quantized {'symmetric' if sym else 'asymmetric'} (plan: "
                         f"{'symmetric' if cfg.sym else 'asymmetric'})")
        gs = opts.group_size or cfg.group_size
        if to == "gguf" and gs % 32:
            raise UserError(f"the plan's group size {gs} is not a multiple of GGUF's block of 32", "pass --group-size 32")
        plan[fqn] = QuantConfig(bits=cfg.bits, group_size=gs, method=opts.quant, sym=sym)
    plan["_default"] = None
    return plan, notes


def _check_target(model, plan, to: str) -> None:
    """Refuse, before anything is quantized or written, a plan that `to` cannot store or whose group size does
    not divide a linear's input width (compressed-tensors' default group of 128 and smollm2-135m's 576)."""
    from llmcompress.quant.apply import linear_fqns

    for fqn, cfg in plan.quantized(linear_fqns(model)).items():
        width = model.get_submodule(fqn).in_features
        if width % cfg.group_size:
            fits = [g for g in (128, 64, 32) if width % g == 0]
            raise UserError(f"--group-size {cfg.group_size} does not divide the input width {width} of {fqn}",
                            f"use --group-size {fits[0]}" if fits else "this model's widths need another group size")
        if to == "gguf":
            from llmcompress.export.gguf import ggml_type_name

            try:
                ggml_type_name(cfg.bits, cfg.sym)
            except UserError as exc:
                raise UserError(f"{fqn}: {exc.message}", exc.hint) from None


def calibration(tokenizer, opts: ExportOptions):
    """GPTQ's calibration blocks, as `nas` draws them (NasConfig defaults unless overridden)."""
    from llmcompress.data import calibration_blocks
    from llmcompress.nas.config import NasConfig

    if tokenizer is None:
        raise UserError("GPTQ needs calibration text, and this model has no tokenizer", "use --quant rtn")
    nc = NasConfig()
    blocks, origin = calibration_blocks(tokenizer, source=opts.calib_source or nc.calib_source, split=nc.calib_split,
                                        seq_len=nc.seq_len, n_blocks=opts.calib_blocks or nc.gptq_blocks, seed=opts.seed)
    return blocks, origin, nc.gptq_act_order


def quantize_embeddings_(model, bits: int = EMBED_BITS, group_size: int = EMBED_GROUP, skip=()) -> dict[str, QuantizedWeight]:
    """Symmetric RTN of the token embedding (and of an untied lm_head), in place (weights become their
    dequantized values). Keys: "model.embed_tokens" style module FQNs."""
    import torch

    from llmcompress.quant import primitives as P
    from llmcompress.quant.apply import QuantizedWeight

    out = {}
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    fqn_of = {id(m): n for n, m in model.named_modules()}
    mods = [emb] + ([head] if head is not None and not _is_tied(model) else [])
    for mod in mods:
        if fqn_of[id(mod)] in skip:  # already quantized (a GPTQ output matrix)
            continue
        q, s, z = P.quantize(mod.weight.data, bits, group_size, sym=True)
        qw = QuantizedWeight(q, s, z, bits, group_size, True)
        with torch.no_grad():
            mod.weight.copy_(qw.dequantize(mod.weight.dtype))
        out[fqn_of[id(mod)]] = qw
    return out


def quantize_for_export(model, tokenizer, to: str, opts: ExportOptions, progress: bool = True) -> tuple[dict[str, QuantizedWeight], dict]:
    """Quantize `model` in place for `to` (weights become their dequantized values, so the torch model is
    exactly what the export holds). Returns (integer weights by module FQN, a summary for the manifest)."""
    from llmcompress.quant.apply import quantize_model_

    plan, notes = export_plan(model, to, opts)
    quantizing = bool(plan.quantized([n for n, _ in model.named_modules()]))
    embed_bits = (opts.embed_bits or (EMBED_BITS if quantizing else 16)) if to == "gguf" else 16
    head_fqn = None
    if opts.separate_output and opts.quant == "gptq" and embed_bits < 16 and _is_tied(model):
        # the output matrix gets its own GPTQ integers (calibrated on the final hidden states), the embedding
        # keeps RTN: a 4-bit embedding + head costs +5.1% perplexity this way, +11.8% by RTN (smollm2-135m, BENCHMARKS.md)
        from llmcompress.io.surgery import untie_output_
        from llmcompress.quant.plan import QuantConfig

        head_fqn = untie_output_(model)
        plan[head_fqn] = QuantConfig(bits=embed_bits, group_size=EMBED_GROUP, method="gptq", sym=True)
    _check_target(model, plan, to)
    info: dict[str, Any] = {"plan": plan.to_dict(), "quant": opts.quant, "notes": notes}
    qweights: dict = {}
    if quantizing or head_fqn is not None:
        if opts.quant == "gptq":
            from llmcompress.quant.gptq import gptq_model_

            blocks, origin, act_order = calibration(tokenizer, opts)
            info["calibration"] = {"data": origin, "blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1]),
                                   "act_order": act_order}
            qweights = gptq_model_(model, plan, blocks, progress=progress, act_order=act_order)
        else:
            qweights = quantize_model_(model, plan, progress=progress)
    if embed_bits < 16:
        qweights.update(quantize_embeddings_(model, bits=embed_bits, skip=set(qweights)))
        info["embeddings"] = f"symmetric {embed_bits}-bit, groups of {EMBED_GROUP} (Q{embed_bits}_0)"
        if head_fqn is not None:
            info["embeddings"] += f"; output matrix untied, its own {embed_bits}-bit GPTQ integers"
    return qweights, info


def _is_tied(model) -> bool:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is not None and head.weight.data_ptr() == emb.weight.data_ptr()


def export_model(src: str, to: str, out: Path, opts: ExportOptions | None = None, *, overwrite: bool = False,
                 progress: bool = True, device="cpu", dtype=None, max_memory: int | None = None) -> dict:
    """Load `src` (alias, HF dir, llmcompress output, .gguf), quantize by `opts`, write `to` at `out`.

    to="gguf": one file at `out`; to="compressed-tensors": a directory. Returns a summary dict (also written
    next to a compressed-tensors checkpoint in its manifest; for GGUF, in its `llmcompress.*` fields).
    device, dtype: where and in which dtype the model is loaded and quantized (None: float32); the files
    are written from the CPU, in the save dtype.
    max_memory: bytes the model may take (None: the memory available). Above it, a compressed-tensors
    export streams the model layer by layer (`export_streamed`, said on stderr); a GGUF export cannot.
    """
    from llmcompress.io.load import load_model

    opts = opts or ExportOptions()
    opts.validate(to)
    out = Path(out)
    info = world()
    if not info.is_main and opts.quant != "gptq":  # under torchrun: RTN has nothing to spread, rank 0 exports alone
        return {"format": to, "rank": info.rank}
    group = info if opts.quant == "gptq" else DistInfo()  # the ranks that take part (RTN: rank 0 alone, no collective)
    _refuse_existing(out, overwrite)
    group.barrier()  # every rank has checked --out before rank 0 can write it
    import torch

    from llmcompress.io.stream import should_stream

    if to == "compressed-tensors":  # rank 0 decides (the others' loads change what is free): every rank takes one path
        what = f"{opts.quant.upper()} quantization"
        path = group.broadcast(should_stream(src, dtype or torch.float32, device, max_memory, what=what) if info.is_main else None)
        if path is not None:
            return export_streamed(src, path, out, opts, overwrite=overwrite, progress=progress, device=device, dtype=dtype)
    elif max_memory is not None:
        raise UserError("--max-memory applies to --to compressed-tensors (written layer by layer); a GGUF file is "
                        "written from the whole model", "drop --max-memory, or export --to compressed-tensors")
    lm = load_model(src, device=device, dtype=dtype)
    return export_loaded(lm, to, out, opts, overwrite=overwrite, progress=progress)


def export_streamed(src: str, path: Path, out: Path, opts: ExportOptions, *, overwrite: bool = False, progress: bool = True,
                    device="cpu", dtype=None) -> dict:
    """A compressed-tensors export of the safetensors checkpoint at `path` (the model `src`) streamed layer
    by layer: one decoder layer in memory at a time, quantized (RTN, or GPTQ on its own Hessians) and
    written as its own shard. Same tensors as the in-memory export."""
    from transformers import AutoTokenizer

    from llmcompress.export.compressed_tensors import write_compressed_tensors_streamed
    from llmcompress.io.stream import LayerRunner
    from llmcompress.runtime import source_dtype_of_spec

    to = "compressed-tensors"
    runner = LayerRunner.open(path, dtype=dtype, device=device)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tok = None
    plan, notes = export_plan(runner.model, to, opts)
    _check_target(runner.model, plan, to)
    info: dict[str, Any] = {"plan": plan.to_dict(), "quant": opts.quant, "notes": notes, "streamed": True}
    blocks, act_order = None, False
    if opts.quant == "gptq" and len(plan.quantized([n for n, _ in runner.model.named_modules()])):
        blocks, origin, act_order = calibration(tok, opts)
        info["calibration"] = {"data": origin, "blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1]),
                               "act_order": act_order}
    float_dtype = opts.save_dtype or source_dtype_of_spec(src)
    summary: dict[str, Any] = {"format": to, "source": src, "float_dtype": float_dtype, **info}
    res = write_compressed_tensors_streamed(runner, tok, out, plan=plan, quant=opts.quant, blocks=blocks, act_order=act_order,
                                            float_dtype=float_dtype, manifest_extra={"export": summary}, overwrite=overwrite,
                                            progress=progress)
    if not world().is_main:  # under torchrun: this rank quantized its share of the GPTQ linears; rank 0 wrote
        return summary
    summary.update(res)
    summary["parameters"] = summary.get("parameters") or _manifest_parameters(out)
    return summary


def _manifest_parameters(out: Path) -> int:
    try:
        return int(json.loads((Path(out) / "llmcompress.json").read_text()).get("parameters", 0))
    except (OSError, ValueError):
        return 0


def _refuse_existing(out: Path, overwrite: bool) -> None:
    from llmcompress.errors import OutputExists

    if out.exists() and not overwrite:
        raise OutputExists(f"{out} already exists", "choose another --out, or pass --overwrite")


def export_loaded(lm, to: str, out: Path, opts: ExportOptions, *, overwrite: bool = False, progress: bool = True,
                  qweights: dict | None = None, info: dict | None = None) -> dict:
    """export_model for an already-loaded `LoadedModel` (quantized here unless `qweights` is given)."""
    from llmcompress.io.dtypes import source_dtype_of

    model, tok = lm.model, lm.tokenizer
    dtype = opts.save_dtype or source_dtype_of(lm)
    if qweights is None:
        qweights, info = quantize_for_export(model, tok, to, opts, progress=progress)
    info = dict(info or {})
    summary: dict[str, Any] = {"format": to, "source": lm.source, "float_dtype": dtype,
                               "parameters": sum(p.numel() for p in model.parameters()), **info}
    if not world().is_main:  # under torchrun: the other ranks' share (GPTQ linears) is done; rank 0 writes
        return summary
    if next(model.parameters()).device.type != "cpu":  # the writers read tensors from host memory
        model.to("cpu")
    if to == "gguf":
        from llmcompress.export.gguf import write_gguf

        meta = {"source": lm.source, "quant": json.dumps({k: v for k, v in info.items() if k != "plan"}, default=str)}
        res = write_gguf(model, out, qweights=qweights, float_dtype=dtype, tokenizer=tok,
                         name=Path(str(lm.source)).name, metadata=meta, overwrite=overwrite,
                         separate_output=opts.separate_output)
    else:
        from llmcompress.export.compressed_tensors import write_compressed_tensors

        res = write_compressed_tensors(model, tok, out, qweights=qweights, float_dtype=dtype,
                                       manifest_extra={"export": summary}, overwrite=overwrite)
    summary.update(res)
    return summary


__all__ = ["ExportOptions", "export_loaded", "export_model", "export_plan", "export_streamed", "load_plan", "quantize_for_export"]
