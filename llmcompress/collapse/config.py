"""Typed configuration of a collapse run, loadable from a YAML search spec (unknown keys are errors)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from llmcompress import spec
from llmcompress.errors import UserError
from llmcompress.io.load import DEFAULT_MODEL
from llmcompress.spec import MAX_BATCH, MAX_COUNT, MAX_SEED, MAX_SEQ, MAX_TOKENS, Int, Real


class Method(str, Enum):
    """The `method` choices (the field holds the value string)."""

    GELACO = "gelaco"
    SHORTGPT = "shortgpt"
    LACO = "laco"
    DROP_SEARCH = "drop-search"


METHODS = tuple(m.value for m in Method)
FITNESS_DTYPES = ("auto", "float32", "bfloat16")
KINDS = ("attention", "mlp", "norm")  # merge-coefficient kinds; "other" parameters follow "mlp"


@dataclass
class CollapseConfig:
    """Everything that decides a collapse run's result (the output directory and progress do not).

    Attributes:
        model: model spec (alias, HF directory, .gguf, hub id).
        method: gelaco (partition + free merge coefficients), drop-search (same search, alpha fixed to 0),
            shortgpt (drop lowest Block Influence), laco (greedy RDSC merging of adjacent layers).
        pareto: multi-objective mode (NSGA-II over layers and KL); else single-objective at `target_layers`.
        target_layers / ratio: layer budget of single-objective mode (ratio = fraction of layers kept).
        min_layers: smallest layer count on the Pareto front (default: half the depth).
        population, generations, seed: search size and seed (generations after the initial population).
        calib_*: calibration data; the validation split is disjoint (same seed, next blocks).
        kl_topk: how many of the original's top log-probabilities are cached per position for the KL.
        kl_stride: score the KL at every `kl_stride`-th position (the head is the costliest layer).
        sim_blocks: calibration blocks used for the residual-update similarity (memoized per group).
        w_kl, w_sim: fitness = w_kl * KL + w_sim * (1 - similarity).
        alpha_grid: values a merge coefficient may take (must include 0 and 1: endpoints drop/replace).
        alpha_per_kind: one coefficient per module kind (attention, mlp, norm) instead of one per layer.
        p_cut_move, p_cut_flip, p_alpha, p_crossover: mutation and crossover rates.
        max_group: largest number of original layers merged into one.
        protect_first / protect_last: keep the first / last N layers as they are.
        refine_steps: after the search, the solution at the target (Pareto mode: at the counts `save`
            picks) walks up to this many swap moves, then (gelaco) as many swap or merge-coefficient
            moves; each step screens every neighbour on `refine_screen_blocks` calibration blocks and
            evaluates the `refine_top` best in full (refine.py); 0 turns refinement off.
        tune_steps, tune_lr: then (gelaco) the merge coefficients of those solutions are tuned by
            `tune_steps` Adam steps at `tune_lr` on the calibration KL, within [0, 1], and kept if they
            lower the validation fitness (tune.py); 0 turns tuning off.
        baselines: baselines computed (and seeded into the population) in a gelaco/drop-search run.
        laco_threshold: LaCo's representation-similarity acceptance threshold; laco_blocks: its data size.
        max_cache_gb: memory budget for cached boundary states (beyond it they go to disk).
        prefix_cache_gb: memory for candidates' own boundary states, so that a candidate sharing a prefix of
            groups with one scored before starts at the deepest shared boundary (exact; 0 turns it off).
        racing: stop scoring an offspring once its KL's lower bound keeps it out of the survivors (exact).
        fitness_dtype: float32 (exact) or bfloat16 (candidate layers under autocast, KL in fp32; faster on
            CPUs with bf16 matmuls and on GPUs, fitness within bf16 tolerance); auto: bfloat16 on a GPU or a
            CPU with native bf16 matmuls (avx512_bf16 / amx_bf16), else float32 (`resolve_fitness_dtype`).
        batch_blocks: calibration blocks per forward.
        save: which solutions get checkpoints: knee | all | comma-separated layer counts.
        eval_tokens / eval_seq_len: WikiText-2 test tokens for the report's perplexity (0 skips it).
        piqa_limit: PIQA examples in the report (0 skips it).
        budget_minutes: size calibration/validation tokens, population, generations, the walk and tuning to
            this many minutes from a short measurement of evaluation speed (budget.py); the report says what
            was chosen. Overrides those fields.
    """

    model: str = DEFAULT_MODEL
    method: str = Method.GELACO.value
    pareto: bool = True
    target_layers: int | None = None
    ratio: float | None = None
    min_layers: int | None = None
    population: int = 8
    generations: int = 4
    seed: int = 0
    calib_source: str = "wikitext2"
    calib_split: str = "valid"
    seq_len: int = 256
    calib_tokens: int = 8192
    val_tokens: int = 16384
    kl_topk: int = 64
    kl_stride: int = 4
    sim_blocks: int = 1
    w_kl: float = 1.0
    w_sim: float = 0.1
    alpha_grid: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    alpha_per_kind: bool = True
    p_cut_move: float = 0.8
    p_cut_flip: float = 0.3
    p_alpha: float = 0.05
    p_crossover: float = 0.7
    max_group: int = 4
    protect_first: int = 1
    protect_last: int = 1
    refine_steps: int = 4
    refine_screen_blocks: int = 4
    refine_top: int = 4
    tune_steps: int = 48
    tune_lr: float = 0.05
    baselines: list[str] = field(default_factory=lambda: ["shortgpt", "laco"])
    laco_threshold: float = 0.95
    laco_blocks: int = 1
    max_cache_gb: float = 2.0
    prefix_cache_gb: float = 1.0
    racing: bool = True
    fitness_dtype: str = "auto"
    batch_blocks: int = 4
    save: str = "knee"
    eval_tokens: int = 2048
    eval_seq_len: int = 512
    piqa_limit: int = 20
    budget_minutes: float | None = None  # size tokens, population and walk to this many minutes (budget.py)
    save_dtype: str | None = None  # dtype of saved checkpoints (None: the source model's; io/dtypes.py)
    version: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of the fields that decide the search result (a resume must match it)."""
        from llmcompress.io.rundir import fingerprint

        return fingerprint(self.to_dict(), skip=("save", "eval_tokens", "eval_seq_len", "piqa_limit", "max_cache_gb", "generations", "save_dtype", "prefix_cache_gb", "racing"))

    def validate(self, n_layers: int | None = None) -> None:
        """Raise UserError on bad values; with `n_layers`, also check the layer budget against the depth."""
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}", f"use one of {', '.join(METHODS)}")
        spec.check_ranges(self, RANGES)
        self.save_counts()
        if self.fitness_dtype not in FITNESS_DTYPES:
            raise UserError(f"fitness_dtype {self.fitness_dtype!r} is not auto, float32 or bfloat16",
                            "use fitness_dtype: auto, float32 (exact) or bfloat16")
        if self.save_dtype is not None:
            from llmcompress.io.dtypes import torch_dtype

            torch_dtype(self.save_dtype)  # UserError on an unknown name
        if not self.pareto and self.target_layers is None and self.ratio is None:
            raise UserError("no layer budget given", "pass --pareto, --target-layers N or --ratio R")
        if 0.0 not in self.alpha_grid or 1.0 not in self.alpha_grid:
            raise UserError("alpha_grid must include 0 and 1", "e.g. alpha_grid: [0.0, 0.5, 1.0]")
        for b in self.baselines:
            if b not in ("shortgpt", "laco"):
                raise UserError(f"unknown baseline {b!r}", "use shortgpt and/or laco")
        if self.calib_tokens < self.seq_len or self.val_tokens < self.seq_len:
            raise UserError("calibration and validation need at least one block each", f"use {self.seq_len} tokens or more")
        if n_layers is not None:
            target = self.resolved_target(n_layers)
            if target is not None and not 2 <= target < n_layers:
                raise UserError(
                    f"target of {target} layers is out of range for a model with {n_layers} layers",
                    f"use 2..{n_layers - 1}",
                )
            if self.min_layers is not None and not 2 <= self.min_layers < n_layers:
                raise UserError(f"min_layers {self.min_layers} is out of range", f"use 2..{n_layers - 1}")

    def save_counts(self) -> list[int] | None:
        """The layer counts `save` names (None for knee or all); UserError for anything else."""
        if self.save in ("knee", "all"):
            return None
        try:
            counts = [int(x) for x in str(self.save).split(",") if x.strip()]
        except ValueError:
            counts = []
        if not counts or any(not 2 <= n <= MAX_COUNT for n in counts):
            raise UserError(f"--save {self.save!r} is not knee, all or a list of layer counts (each >= 2)", "e.g. --save knee or --save 22,26")
        return counts

    def resolved_target(self, n_layers: int) -> int | None:
        if self.target_layers is not None:
            return self.target_layers
        if self.ratio is not None:
            return max(1, round(self.ratio * n_layers))
        return None

    def layer_range(self, n_layers: int) -> tuple[int, int]:
        """(lowest, highest) layer count a candidate may have."""
        target = self.resolved_target(n_layers)
        if not self.pareto and target is not None:
            return target, target
        lo = self.min_layers if self.min_layers is not None else max(2, (n_layers + 1) // 2)
        return lo, n_layers - 1

    @property
    def val_offset(self) -> int:
        """Validation blocks start after the calibration blocks in the same seeded order (disjoint)."""
        return self.calib_tokens // self.seq_len


FIELDS = {f.name for f in dataclasses.fields(CollapseConfig)}


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX; read from /proc/cpuinfo, Linux only)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_fitness_dtype(name: str, device_type: str = "cpu") -> str:
    """`fitness_dtype` with auto resolved: bfloat16 where it is fast (a GPU, a CPU with native bf16), else float32."""
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" or (device_type == "cpu" and native_bf16_cpu()) else "float32"

# Valid values of the numeric fields (flag names where the CLI has one, spec keys otherwise).
RANGES = {
    "target_layers": Int("--target-layers", 2, MAX_COUNT, note="keep 2 layers or more"),
    "ratio": Real("--ratio", 0.0, 1.0, lo_open=True, hi_open=True, note="e.g. --ratio 0.75 keeps 75% of the layers"),
    "min_layers": Int("min_layers", 2, MAX_COUNT),
    "population": Int("--population", 1, MAX_COUNT, note="e.g. --population 8"),
    "generations": Int("--generations", 1, MAX_COUNT, note="e.g. --generations 4"),
    "seed": Int("--seed", 0, MAX_SEED),
    "seq_len": Int("seq_len", 2, MAX_SEQ),
    "calib_tokens": Int("--calib-tokens", 1, MAX_TOKENS),
    "val_tokens": Int("--val-tokens", 1, MAX_TOKENS),
    "kl_topk": Int("kl_topk", 1, MAX_COUNT),
    "kl_stride": Int("kl_stride", 1, MAX_SEQ),
    "sim_blocks": Int("sim_blocks", 1, MAX_COUNT),
    "w_kl": Real("w_kl", 0.0, 1e6),
    "w_sim": Real("w_sim", 0.0, 1e6),
    "alpha_grid": Real("alpha_grid", 0.0, 1.0),
    "p_cut_move": Real("p_cut_move", 0.0, 1.0),
    "p_cut_flip": Real("p_cut_flip", 0.0, 1.0),
    "p_alpha": Real("p_alpha", 0.0, 1.0),
    "p_crossover": Real("p_crossover", 0.0, 1.0),
    "max_group": Int("max_group", 2, MAX_COUNT),
    "protect_first": Int("protect_first", 0, MAX_COUNT),
    "protect_last": Int("protect_last", 0, MAX_COUNT),
    "refine_steps": Int("--refine-steps", 0, MAX_COUNT, note="0 turns refinement off"),
    "refine_screen_blocks": Int("refine_screen_blocks", 1, MAX_COUNT),
    "refine_top": Int("refine_top", 1, MAX_COUNT),
    "tune_steps": Int("--tune-steps", 0, MAX_COUNT, note="0 turns tuning off"),
    "tune_lr": Real("tune_lr", 0.0, 10.0, lo_open=True),
    "laco_threshold": Real("laco_threshold", -1.0, 1.0),
    "laco_blocks": Int("laco_blocks", 1, MAX_COUNT),
    "max_cache_gb": Real("--max-cache-gb", 0.0, 1e6, note="0 keeps every cached state on disk"),
    "budget_minutes": Real("--budget-minutes", 0.0, 1e6, lo_open=True, note="e.g. --budget-minutes 20"),
    "prefix_cache_gb": Real("prefix_cache_gb", 0.0, 1e6, note="0 turns the candidates' prefix states off"),
    "batch_blocks": Int("batch_blocks", 1, MAX_BATCH),
    "eval_tokens": Int("--eval-tokens", 0, MAX_TOKENS, note="0 skips the report's perplexity"),
    "eval_seq_len": Int("eval_seq_len", 2, MAX_SEQ),
    "piqa_limit": Int("--piqa-limit", 0, MAX_COUNT, note="0 skips PIQA"),
}


def config_from_dict(data: dict[str, Any], base: CollapseConfig | None = None) -> CollapseConfig:
    """A config from a dict; unknown keys raise UserError."""
    return spec.config_from_dict(CollapseConfig, data, base)


def load_spec(path: Path) -> CollapseConfig:
    """Load a YAML search spec (a mapping of CollapseConfig fields)."""
    return spec.load_spec(CollapseConfig, path, "searches/collapse-default.yaml")
