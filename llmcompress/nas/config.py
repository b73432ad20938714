"""Typed configuration of a NAS run, loadable from a YAML search spec (unknown keys are errors)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from llmcompress import spec
from llmcompress.actcomp import options as act_options
from llmcompress.errors import UserError
from llmcompress.io.load import DEFAULT_MODEL
from llmcompress.spec import MAX_BATCH, MAX_COUNT, MAX_SEED, MAX_SEQ, MAX_TOKENS, Int, Real


class Mode(str, Enum):
    JOINT = "joint"
    SEQUENTIAL = "sequential"
    UNIFORM = "uniform"


class CostModel(str, Enum):
    LUT = "lut"
    ANALYTIC = "analytic"
    MEASURED = "measured"


class QuantMethod(str, Enum):
    RTN = "rtn"
    GPTQ = "gptq"


MODES = tuple(m.value for m in Mode)
COST_MODELS = tuple(m.value for m in CostModel)
EXPORT_FORMATS = ("gguf", "compressed-tensors")


@dataclass
class NasConfig:
    """Everything that decides a NAS run's result.

    Attributes:
        model: model spec (alias, HF directory, .gguf, hub id).
        mode: joint (architecture and bits searched together), sequential (architecture searched in full
            precision, then bits under the same budget), uniform (dense architecture, one bit width, the same quantizer).
        baselines: extra modes run in the same command for the report (their arch.json only).
        target_latency: modeled latency relative to the dense model (e.g. 0.6).
        target_size_mb: size of the packed weights in MB (10**6 bytes), embeddings included.
        target_bits: average bits per quantized linear weight (nominal, scales excluded).
        bits: bit widths a linear layer may take (each in 2..16).
        head_bits: bit widths the output head may take (the tied embedding/lm_head, or an untied lm_head);
            empty (default): the head stays float and is not counted in the average bits. When given, the
            head is one more searched choice, round-to-nearest quantized (a tied tensor is also the embedding
            table, which GPTQ's objective does not cover), costed in latency, size and average bits (a 16-bit
            head counts 16 bits per weight), and shipped in hf/, compressed-tensors and gguf (gguf: 4, 5, 8, 16).
        group_size: quantization group along the input dimension; 0 = auto (128 if it divides every
            searched width, else the largest power of two below it that does; 64 for smollm2-135m).
        width_choices: MLP intermediate widths as fractions of the dense width (channels ranked by
            importance, so a narrower choice is a prefix of a wider one).
        allow_skip: a decoder layer may be skipped; min_keep_frac: fewest layers kept (fraction).
        cost_model: lut (decode time per choice measured on this machine in torch), analytic (bytes moved per
            decoded token) or measured (seconds per decoded token of the GGUF export in llama.cpp, from probe
            GGUFs timed on this machine and cached; needs llama-cpp-python and bits in 4, 5, 8, 16;
            nas/measured.py). All are relative to the dense float model.
        context_len: KV-cache length assumed by the cost models.
        train_tokens, seq_len, batch_size: search data (steps = train_tokens / (seq_len * batch_size)).
        search_steps: gradient steps of the logits (0, the default: no gradient phase, the plan is the
            calibrated sensitivity proxy's argmax + repair/upgrade, then the validated step; None: one step
            per batch of the search data). Default 0 because the ablation (README, BENCHMARKS.md) found the
            gradient steps gave exactly the zero-step plan at 2.6x the search time.
        lr: Adam learning rate of the architecture logits; tau_start/tau_end: Gumbel temperature
            (annealed exponentially); lam: penalty weight of max(0, cost / target - 1).
        hidden_mse: weight of a final-hidden-state MSE next to the logit KL (0 = off).
        quant_method: the quantizer of every step: the supernet, the sensitivities, the validated step and the
            export all use the same weights (nas/qbank.py): rtn (round-to-nearest) or gptq (error compensation
            with Hessians of the teacher's inputs on `gptq_blocks` calibration blocks; `gptq_act_order`:
            columns in order of decreasing input energy, static groups). Every mode, uniform included.
        init_kappa: logits start at -init_kappa * (calibrated error of the choice) / (median error of the middle bit width), from
            a diagonal-Hessian proxy on `sensitivity_blocks` calibration blocks (0 = all logits start equal;
            needs search_steps > 0).
        bits_init: what the bit-width logits start from: proxy (the diagonal-Hessian proxy, each layer's
            share scaled by one measured KL per layer and level: 2 forwards per layer) or measured (the KL of
            each linear quantized alone at each width, the rest float: one forward per linear and quantized
            width, on the same sensitivity_blocks // 4 blocks; repair is then a greedy knapsack on measured
            KL). Architecture choices (skip, width) and the head start from their calibrated KL either way.
        sequential_splits: the oracle split of `sequential`: stage 1 (architecture at full precision) is run
            with its latency/size target at each of these fractions of dense, and the validated step keeps
            the best plan (nas/search.py:search_sequential).
        sequential_quant_aware: `sequential` also runs stage 1 costed at each quantized bit width it could
            end at (quantization-aware NAS-then-quantize).
        refine_evals: level-switch mutations scored by measured KL after the search (nas/refine.py; 0 = off,
            the default: on smollm2 they lowered held-out KL by 3-4% but raised test perplexity, see README).
        refine_blocks: held-out calibration blocks (disjoint from the search's) that score the start
            candidates (the searched architecture, and the uniform plan for joint) and the mutations.
        checkpoint_every: steps between atomic search checkpoints (for --resume).
        eval_tokens, eval_seq_len: WikiText-2 raw test tokens for the report's perplexity (0 skips).
        measure_speed: measure CPU prefill/decode speed of the results.
        export: deployable formats written next to hf/ (gguf -> OUT/gguf/model.gguf, compressed-tensors ->
            OUT/compressed-tensors/); gguf needs every searched bit width in 4, 5, 8, 16 (llama.cpp has
            no kernel for 2/3-bit on 576-wide rows) and a group size divisible by 32; with gguf, 8-bit
            layers are quantized symmetric (Q8_0).
        save_dtype: dtype of the saved float tensors (None: the source model's; io/dtypes.py).
        act_rank / act_budget: activation compression of the supernet's linears during the search (rank R
            random sketches of their saved inputs, or "auto" with act_budget of the bytes; llmcompress/actcomp).
    """

    model: str = DEFAULT_MODEL
    mode: str = Mode.JOINT.value
    baselines: list[str] = field(default_factory=lambda: ["uniform"])
    target_latency: float | None = None
    target_size_mb: float | None = None
    target_bits: float | None = None
    bits: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6, 8, 16])
    head_bits: list[int] = field(default_factory=list)
    group_size: int = 0
    width_choices: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    allow_skip: bool = True
    min_keep_frac: float = 0.5
    cost_model: str = CostModel.ANALYTIC.value
    context_len: int = 256
    calib_source: str = "wikitext2"
    calib_split: str = "valid"
    train_tokens: int = 16384
    search_steps: int | None = 0
    seq_len: int = 128
    batch_size: int = 4
    lr: float = 0.05
    tau_start: float = 4.0
    tau_end: float = 0.3
    lam: float = 20.0
    hidden_mse: float = 0.0
    quant_method: str = QuantMethod.GPTQ.value
    gptq_blocks: int = 128
    gptq_act_order: bool = True
    init_kappa: float = 2.0
    bits_init: str = "proxy"
    sensitivity_blocks: int = 8
    sequential_splits: list[float] = field(default_factory=lambda: [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    sequential_quant_aware: bool = True
    refine_evals: int = 0
    refine_blocks: int = 32
    checkpoint_every: int = 8
    eval_tokens: int = 8192
    eval_seq_len: int = 512
    measure_speed: bool = True
    export: list[str] = field(default_factory=list)
    save_dtype: str | None = None
    act_rank: int | str | None = None
    act_budget: float = 0.25
    seed: int = 0
    version: int = 6

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def steps(self) -> int:
        """Batches of search data (calibration blocks = steps * batch_size)."""
        return max(1, self.train_tokens // (self.seq_len * self.batch_size))

    @property
    def grad_steps(self) -> int:
        """Gradient steps of the architecture logits."""
        return self.steps if self.search_steps is None else self.search_steps

    def targets(self) -> dict[str, float]:
        t = {"latency": self.target_latency, "size_mb": self.target_size_mb, "bits": self.target_bits}
        return {k: v for k, v in t.items() if v is not None}

    def fingerprint(self) -> str:
        """Hash of the fields that decide the search (a resume must match it)."""
        from llmcompress.io.rundir import fingerprint

        return fingerprint(self.to_dict(), skip=("eval_tokens", "eval_seq_len", "measure_speed", "checkpoint_every", "baselines", "export", "save_dtype"))

    def validate(self) -> None:
        """Raise UserError on values that are wrong whatever the model (model checks: space.py)."""
        if self.mode not in MODES:
            raise UserError(f"unknown mode {self.mode!r}", f"use one of {', '.join(MODES)}")
        for b in self.baselines:
            if b not in MODES:
                raise UserError(f"unknown baseline mode {b!r}", f"use any of {', '.join(MODES)}")
        spec.check_ranges(self, RANGES)
        if not self.targets():
            raise UserError("no target given", "pass --target-latency R, --target-size-mb M or --target-bits B")
        if not self.bits:
            raise UserError("no bit widths given", "use e.g. --bits 2,3,4,8,16")
        if self.target_bits is not None and not min(self.bits) <= self.target_bits <= 16:
            raise UserError(
                f"--target-bits {self.target_bits} is outside the reachable range {min(self.bits)}..{max(self.bits)}",
                "choose a target between the smallest and largest of --bits",
            )
        if self.mode == Mode.SEQUENTIAL.value or Mode.SEQUENTIAL.value in self.baselines:
            if not self.sequential_splits and not self.sequential_quant_aware:
                raise UserError("sequential has no stage 1 to run (sequential_splits empty and sequential_quant_aware off)",
                                "e.g. sequential_splits: [1.0, 0.8, 0.6]")
        if self.init_kappa <= 0 and self.search_steps == 0:
            raise UserError("init_kappa 0 (equal starting logits) with search_steps 0 leaves nothing to decide the plan",
                            "set search_steps (e.g. 8, or null for one per batch), or keep init_kappa > 0")
        if not self.width_choices:
            raise UserError("no width choices given", "e.g. width_choices: [0.25, 0.5, 0.75, 1.0]")
        if self.cost_model not in COST_MODELS:
            raise UserError(f"unknown cost model {self.cost_model!r}", f"use one of {', '.join(COST_MODELS)}")
        if self.cost_model == CostModel.MEASURED.value:
            from llmcompress.nas.measured import require_runtime

            require_runtime()
            bad = sorted(b for b in set(self.bits) | set(self.head_bits) if b not in (4, 5, 8, 16))
            if bad:
                raise UserError(f"--cost-model measured has no llama.cpp type for {bad}-bit layers (no ggml block of 32)",
                                "search with --bits 4,8,16 (or 4,5,8,16)")
        if self.bits_init not in BITS_INITS:
            raise UserError(f"unknown bits_init {self.bits_init!r}", f"use one of {', '.join(BITS_INITS)}")
        if self.quant_method not in {m.value for m in QuantMethod}:
            raise UserError(f"unknown quantization method {self.quant_method!r}", "use rtn or gptq")
        if self.train_tokens < self.seq_len * self.batch_size:
            raise UserError(f"--train-tokens must be at least {self.seq_len * self.batch_size}", "one batch at least")
        for f in self.export:
            if f not in EXPORT_FORMATS:
                raise UserError(f"unknown export format {f!r}", f"use --export {','.join(EXPORT_FORMATS)} (or a subset)")
        if "gguf" in self.export:
            bad = sorted(b for b in set(self.bits) | set(self.head_bits) if b not in (4, 5, 8, 16))
            if bad:
                raise UserError(f"--export gguf cannot store {bad}-bit layers (no llama.cpp block of 32 for them; K-quants "
                                "need rows divisible by 256)", "search with --bits 4,8,16 (or 4,5,8,16)")
            if self.group_size and self.group_size % 32:
                raise UserError(f"--export gguf needs a group size divisible by 32, got {self.group_size}", "use --group-size 32 or 64")
        if self.save_dtype is not None:
            from llmcompress.io.dtypes import torch_dtype

            torch_dtype(self.save_dtype)


BITS_INITS = ("proxy", "measured")

# Valid values of the numeric fields (flag names where the CLI has one, spec keys otherwise); cross-field
# checks (target bits within the bit widths, tokens for one batch) are in NasConfig.validate.
RANGES = {
    "target_latency": Real("--target-latency", 0.0, 100.0, lo_open=True, note="e.g. --target-latency 0.6 (relative to dense)"),
    "target_size_mb": Real("--target-size-mb", 0.0, 1e9, lo_open=True, note="e.g. --target-size-mb 60"),
    "target_bits": Real("--target-bits", 0.0, 16.0, lo_open=True, note="e.g. --target-bits 4"),
    "bits": Int("--bits", 2, 16, note="use e.g. --bits 2,3,4,8,16"),
    "head_bits": Int("head_bits", 2, 16, note="e.g. head_bits: [4, 8, 16]"),
    "group_size": Int("--group-size", 0, MAX_SEQ, note="0 picks one; e.g. --group-size 64"),
    "width_choices": Real("width_choices", 0.0, 1.0, lo_open=True),
    "min_keep_frac": Real("min_keep_frac", 0.0, 1.0, lo_open=True),
    "context_len": Int("context_len", 1, MAX_SEQ),
    "train_tokens": Int("--train-tokens", 1, MAX_TOKENS),
    "search_steps": Int("search_steps", 0, MAX_COUNT, note="0: no gradient phase (proxy + repair)"),
    "seq_len": Int("seq_len", 2, MAX_SEQ),
    "batch_size": Int("batch_size", 1, MAX_BATCH),
    "lr": Real("lr", 0.0, 10.0, lo_open=True),
    "tau_start": Real("tau_start", 0.0, 1e6, lo_open=True),
    "tau_end": Real("tau_end", 0.0, 1e6, lo_open=True),
    "lam": Real("lam", 0.0, 1e9),
    "hidden_mse": Real("hidden_mse", 0.0, 1e6),
    "gptq_blocks": Int("gptq_blocks", 1, MAX_COUNT),
    "init_kappa": Real("init_kappa", 0.0, 1e6),
    "sensitivity_blocks": Int("sensitivity_blocks", 1, MAX_COUNT),
    "sequential_splits": Real("sequential_splits", 0.0, 1.0, lo_open=True, note="fractions of dense, e.g. [1.0, 0.8, 0.6]"),
    "refine_evals": Int("refine_evals", 0, MAX_COUNT, note="0 turns refinement off"),
    "refine_blocks": Int("refine_blocks", 1, MAX_COUNT),
    "checkpoint_every": Int("checkpoint_every", 1, MAX_COUNT),
    "eval_tokens": Int("--eval-tokens", 0, MAX_TOKENS, note="0 skips the report's perplexity"),
    "eval_seq_len": Int("eval_seq_len", 2, MAX_SEQ),
    "seed": Int("--seed", 0, MAX_SEED),
    "act_rank": act_options.RANK,
    "act_budget": act_options.BUDGET,
}


def config_from_dict(d: dict[str, Any], base: NasConfig | None = None) -> NasConfig:
    """A copy of `base` with the fields of `d` set; unknown keys are errors."""
    return spec.config_from_dict(NasConfig, d, base)


def load_spec(path: Path) -> NasConfig:
    return spec.load_spec(NasConfig, path, "searches/nas-default.yaml")
