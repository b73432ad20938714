"""Setup of a run: check the options and --out, load the training blocks, plan the student's layers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmcompress.dist import DistInfo
from llmcompress.distill.config import DistillConfig
from llmcompress.distill.segments import (
    bi_keep,
    layer_map_from_keep,
    uniform_keep,
    validate_layer_map,
)
from llmcompress.errors import DataError, UserError
from llmcompress.io.rundir import claim
from llmcompress.metrics import block_influence

STALE = ("work", "student", "train_log.jsonl", "report.md", "metrics.json")  # removed by --overwrite (io/rundir.py)


def prepare_out(cfg: DistillConfig, out: Path, overwrite: bool, resume: bool, dist: DistInfo) -> dict:
    """Check --out, and return the saved run state when resuming (empty otherwise)."""
    out = Path(out)
    run_dir = claim(out, overwrite=overwrite, resume=resume, stale=STALE) if dist.is_main else None
    state_path = out / "work" / "state.json"
    state: dict = {}
    finished = out / "student" / "llmcompress.json"  # a finished run's work/ is gone; its manifest has the settings
    if resume and not state_path.is_file() and finished.is_file():
        stored = json.loads(finished.read_text()).get("config") or {}
        if saved_settings({k: v for k, v in stored.items() if k in cfg.result_dict()}) != cfg.result_dict():
            raise UserError(
                f"--resume: {out} holds a run with different settings",
                "rerun with the same options, or use --overwrite to start again",
            )
        raise UserError(f"--resume: {out} holds a finished run, there is nothing to resume", "use --overwrite to run it again")
    if resume and state_path.is_file():
        state = json.loads(state_path.read_text())
        if saved_settings(state.get("config") or {}) != cfg.result_dict():
            raise UserError(
                f"--resume: {out} holds a run with different settings",
                "rerun with the same options, or use --overwrite to start again",
            )
    elif run_dir is not None:
        run_dir.start(resuming=False, create=False)  # --overwrite: the previous run's files go (also on a --resume without state)
    dist.barrier()
    return state or {"config": cfg.result_dict(), "phase1_done": [], "phase2_done": [], "e2e_done": False}


def saved_settings(saved: dict) -> dict:
    """A run's saved settings, with options added since it was saved set to their defaults.

    Their defaults reproduce what the older code did (e.g. ce_weight 0, epochs 1), so such a run resumes.
    """
    defaults = DistillConfig().result_dict()
    return {**{k: v for k, v in defaults.items() if k not in saved}, **saved}


def load_blocks(tokenizer, cfg: DistillConfig, model):
    """Training blocks: the budget's batches divided by --epochs (fewer when the data is shorter; training cycles over them)."""
    from llmcompress.data import calibration_blocks

    tokens_per_step = cfg.batch_size * cfg.seq_len
    n_blocks = math.ceil(math.ceil(cfg.train_tokens / tokens_per_step) / cfg.epochs) * cfg.batch_size
    try:
        blocks, label = calibration_blocks(
            tokenizer, cfg.data, split=cfg.data_split, seq_len=cfg.seq_len, n_blocks=n_blocks, seed=cfg.seed,
            model=model, allow_self_fallback=False,
        )
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"cannot read the training data {cfg.data!r}: {exc.strerror or exc}", "check --data") from None
    usable = (blocks.shape[0] // cfg.batch_size) * cfg.batch_size
    if usable < cfg.batch_size:
        raise DataError(
            f"the data {label} gives {blocks.shape[0]} blocks of {cfg.seq_len} tokens, fewer than one batch of {cfg.batch_size}",
            "use more data, a smaller --seq-len or a smaller --batch-size",
        )
    return blocks[:usable], label


def read_student_plan(spec: str, teacher_model) -> list[dict]:
    """Layer map of a student checkpoint, after checking it can be distilled from this teacher."""
    from llmcompress.io.adapters import adapter_for_type, get_adapter
    from llmcompress.io.load import resolve

    kind, where = resolve(spec)
    if kind not in ("dir", "zipped"):
        raise UserError(f"--student {spec} must be a local checkpoint directory", "pass the output of llmcompress collapse")
    where = Path(where)
    config = json.loads((where / "config.json").read_text()) if (where / "config.json").is_file() else {}
    teacher_adapter = get_adapter(teacher_model)
    student_family = adapter_for_type(config.get("model_type", "unknown")).family
    if student_family != teacher_adapter.family:
        raise UserError(
            f"the student is a {student_family} model and the teacher a {teacher_adapter.family} model",
            "distill a student made from this teacher (same architecture family)",
        )
    hidden = config.get("hidden_size", config.get("n_embd"))
    if hidden != teacher_model.config.hidden_size:
        raise UserError(
            f"the student's hidden size {hidden} differs from the teacher's {teacher_model.config.hidden_size}",
            "distill a student made from this teacher",
        )
    manifest_path = where / "llmcompress.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    layer_map = manifest.get("layer_map")
    if not layer_map:
        raise UserError(f"the student {spec} has no layer_map in its llmcompress.json", "pass a checkpoint written by llmcompress collapse or distill")
    n_layers = config.get("num_hidden_layers", config.get("n_layer"))
    if n_layers != len(layer_map):
        raise UserError(f"the student's layer_map has {len(layer_map)} entries for {n_layers} layers", "the checkpoint's manifest is inconsistent")
    return layer_map


def plan_student(cfg: DistillConfig, model, blocks, runner=None) -> tuple[list[dict], list[int] | None]:
    """(layer_map, keep list for a removal student or None for a checkpoint student). With a streamed teacher
    (`runner`, io/stream.py), Block Influence is computed layer by layer on the same blocks."""
    n_teacher = model.config.num_hidden_layers
    if (cfg.keep_layers is None) == (cfg.student is None):
        raise UserError("give exactly one of --keep-layers N and --student PATH", "e.g. --keep-layers 15")
    if cfg.student is not None:
        layer_map = read_student_plan(cfg.student, model)
        validate_layer_map(layer_map, n_teacher)
        return layer_map, None
    from llmcompress.distill.segments import check_student_size

    check_student_size(n_teacher, cfg.keep_layers)
    if cfg.select.value == "bi":
        sample = blocks[: min(4, len(blocks))]
        if runner is not None:
            from llmcompress.io.stream import block_influence_layerwise

            keep = bi_keep(block_influence_layerwise(runner, sample), cfg.keep_layers)
        else:
            from llmcompress.io.forward import boundary_states

            states, _ = boundary_states(model, sample.to(next(model.parameters()).device))
            keep = bi_keep(block_influence(states), cfg.keep_layers)
    else:
        keep = uniform_keep(n_teacher, cfg.keep_layers)
    return layer_map_from_keep(keep), keep



def feature_cache_bytes(cfg: DistillConfig) -> float:
    """Rough size of the teacher feature cache: boundary states of the distinct training tokens (0 if the
    teacher's config is not on disk yet). An upper bound: one boundary per teacher layer at most."""
    from llmcompress.io.preflight import model_config

    config = model_config(cfg.teacher)
    hidden, layers = config.get("hidden_size", config.get("n_embd", 0)), config.get("num_hidden_layers", config.get("n_layer", 0))
    boundaries = min(layers, cfg.segments or cfg.keep_layers or layers) + 1
    per_value = {"fp32": 4}.get(cfg.cache_dtype.value, 2)
    return boundaries * math.ceil(cfg.train_tokens / cfg.epochs) * hidden * per_value
