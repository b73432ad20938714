"""Typed configuration of a distillation run (`llmcompress distill` and `distill()` build the same object)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from llmcompress import spec
from llmcompress.actcomp import options as act_options
from llmcompress.io.load import DEFAULT_MODEL
from llmcompress.spec import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_SEED,
    MAX_SEQ,
    MAX_THREADS,
    MAX_TOKENS,
    Int,
    Real,
    check_ranges,
    choice,
)


class Mode(str, Enum):
    """Training scheme: layer-wise curriculum, or the conventional end-to-end baseline."""

    LAYERWISE = "layerwise"
    E2E = "e2e"


class Select(str, Enum):
    """How `keep_layers` picks the teacher layers a removal student keeps."""

    UNIFORM = "uniform"
    BI = "bi"  # Block Influence: drop the layers whose output is most like their input


class GradCompress(str, Enum):
    """How data-parallel e2e training (torchrun) exchanges gradients (llmcompress/comm/edgc.py)."""

    NONE = "none"  # DDP's all-reduce
    ZIP = "zip"  # lossless ZipCCL: the same bits, fewer bytes
    POWERSGD = "powersgd"  # torch's PowerSGD hook at the fixed rank grad_rank
    EDGC = "edgc"  # PowerSGD with the rank adapted to the gradients' entropy in [grad_rank_min, grad_rank_max]


class HiddenLoss(str, Enum):
    """Per-token hidden-state loss of a segment."""

    MSE = "mse"  # MSE normalised by the target's mean square (scale-free, comparable across segments)
    COSINE = "cosine"


class Precision(str, Enum):
    """Compute precision of training and caching forward/backward passes (autocast)."""

    FP32 = "fp32"
    BF16 = "bf16"


class CacheDtype(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


@dataclass
class DistillConfig:
    """Everything that decides the result of a run (the config hash covers all of it).

    Attributes:
        teacher: teacher model spec (alias, directory, ...).
        keep_layers: student = teacher with only this many layers kept (exclusive with `student`).
        student: path of a student checkpoint whose layers map onto the teacher (manifest `layer_map`).
        select: how removal picks the kept layers (uniform or Block Influence).
        mode: layer-wise curriculum or end-to-end baseline.
        train_tokens: training budget: tokens each student layer is trained on (both modes).
        epochs: passes over the training data: the data is train_tokens / epochs distinct tokens, seen
            `epochs` times (the layer-wise teacher cache is built once and reused on every pass; the
            e2e baseline reruns the teacher on every step).
        segments: number of segments (None: one per student layer).
        data / data_split: training text (named dataset, file or `self`).
        seq_len / batch_size: block length and blocks per optimiser step.
        lr / weight_decay: AdamW settings; lr None = 2e-3 layer-wise, 5e-4 e2e (tuned on smollm2, see
            bench/RESULTS-distill.md); cosine decay to 10% within each segment / run.
        hidden_loss: per-token loss on segment outputs.
        kl_weight / kl_temperature: weight and temperature of the logit KL (last segment, e2e).
        kl_positions: fraction of positions the last segment's logit KL is computed on (saves head FLOPs).
        ce_weight: weight of the next-token cross-entropy on the training text (hard labels), added to
            every logit KL (last segment, e2e mode, e2e steps); 0 = pure distillation. It also adapts the
            student to the training text's domain, so the teacher is no longer its quality ceiling there.
        phase1_fraction: share of each segment's token budget spent on teacher inputs (phase 1).
        mix_start / mix_end: weight of the student's own input at the start/end of phase 2.
        e2e_steps: end-to-end logit-distillation steps after the layer-wise phases.
        e2e_lr: their AdamW learning rate (None: a quarter of the layer-wise lr).
        precision: compute precision of the teacher caching pass, the segments' and e2e forward and
            backward passes (bf16 = autocast; weights, gradients and AdamW state stay fp32, losses are
            computed in fp32). Evaluation always runs in fp32.
        cache_dtype / cache_dir / prefetch: teacher feature cache settings (one shard = one batch).
        eval_tokens: tokens of WikiText-2 raw test for the report's perplexities (0 skips).
        threads: torch intra-op threads (None: torch's default). On a shared CPU, 1 can be much faster.
        seed: everything random derives from it (per segment: seed + segment index).
        grad_compress: gradient exchange of data-parallel e2e training under torchrun: none | zip | powersgd | edgc.
        grad_rank: PowerSGD's fixed rank (powersgd); grad_rank_min / grad_rank_max: EDGC's rank range (it starts at
            the maximum); grad_warmup: dense all-reduce steps before either compresses (>= 2);
            grad_entropy_span: the drop of EDGC's windowed gradient entropy, as a share of its peak, that takes
            the rank from grad_rank_max to grad_rank_min (0.1).
        act_rank / act_budget: activation compression of the trained linears' saved inputs (rank R random
            sketches, or "auto": per-input ranks holding act_budget of the uncompressed bytes; see
            llmcompress/actcomp); None = off. The saved-activation bytes are counted either way.
        act_grad: with act_rank, the sketched weight gradients' form: dense (written into .grad) or factored
            (co-compression: kept as rank-r factors, AdamW stepped from them one linear at a time by
            actcomp.optim.FactoredStep; single process only: DDP all-reduces dense gradients).
    """

    teacher: str = DEFAULT_MODEL
    keep_layers: int | None = None
    student: str | None = None
    select: Select = Select.UNIFORM
    mode: Mode = Mode.LAYERWISE
    train_tokens: int = 16384
    epochs: int = 1
    segments: int | None = None
    data: str = "wikitext2"
    data_split: str | None = "valid"
    seq_len: int = 256
    batch_size: int = 4
    lr: float | None = None
    weight_decay: float = 0.0
    hidden_loss: HiddenLoss = HiddenLoss.MSE
    kl_weight: float = 1.0
    kl_temperature: float = 1.0
    kl_positions: float = 0.25
    ce_weight: float = 0.0
    phase1_fraction: float = 0.25
    mix_start: float = 0.0
    mix_end: float = 1.0
    e2e_steps: int = 0
    e2e_lr: float | None = None
    precision: Precision = Precision.FP32
    cache_dtype: CacheDtype = CacheDtype.BF16
    cache_dir: str | None = None
    prefetch: int = 2
    eval_tokens: int = 8192
    eval_seq_len: int = 512
    seed: int = 0
    threads: int | None = None
    save_dtype: str | None = None  # dtype of the saved student (None: the teacher's source dtype; io/dtypes.py)
    grad_compress: GradCompress = GradCompress.NONE
    grad_rank: int = 8
    grad_rank_min: int = 2
    grad_rank_max: int = 32
    grad_warmup: int = 10
    grad_entropy_span: float = 0.1
    act_rank: int | str | None = None
    act_budget: float = 0.25
    act_grad: act_options.ActGrad = act_options.ActGrad.DENSE
    version: int = 1

    def __post_init__(self) -> None:
        self.select = choice(Select, self.select, "select")
        self.mode = choice(Mode, self.mode, "mode")
        self.hidden_loss = choice(HiddenLoss, self.hidden_loss, "hidden_loss")
        self.cache_dtype = choice(CacheDtype, self.cache_dtype, "cache_dtype")
        self.precision = choice(Precision, self.precision, "precision")
        self.grad_compress = choice(GradCompress, self.grad_compress, "grad_compress")
        self.act_grad = choice(act_options.ActGrad, self.act_grad, "act_grad")
        if self.save_dtype is not None:
            from llmcompress.io.dtypes import torch_dtype

            torch_dtype(self.save_dtype)  # UserError on an unknown name
        if isinstance(self.act_rank, str) and self.act_rank.strip().isdigit():
            self.act_rank = int(self.act_rank)

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-3 if self.mode == Mode.LAYERWISE else 5e-4

    @property
    def e2e_steps_lr(self) -> float:
        """Learning rate of the --e2e-steps phase."""
        return self.e2e_lr if self.e2e_lr is not None else self.learning_rate * 0.25

    def validate(self) -> None:
        """Raise UserError on values that are wrong whatever the teacher (layer counts: plan.py)."""
        from llmcompress.errors import UserError

        check_ranges(self, RANGES)
        act_options.check_grad(self.act_grad, self.act_rank)
        if self.grad_compress != GradCompress.NONE and self.mode == Mode.LAYERWISE and self.e2e_steps < 1:
            raise UserError(
                "--grad-compress applies to data-parallel end-to-end training, and this run has none",
                "use it with --mode e2e or --e2e-steps N under torchrun",
            )
        if self.grad_rank_min > self.grad_rank_max:
            raise UserError(
                f"--grad-rank-min {self.grad_rank_min} is above --grad-rank-max {self.grad_rank_max}",
                "give a range with min <= max, e.g. --grad-rank-min 2 --grad-rank-max 32",
            )
        if self.e2e_lr is not None and (self.mode == Mode.E2E or self.e2e_steps < 1):
            raise UserError(
                "--e2e-lr sets the learning rate of the --e2e-steps phase, and this run has none",
                "add --e2e-steps N to a layer-wise run, or use --lr with --mode e2e",
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in d.items()}

    def result_dict(self) -> dict[str, Any]:
        """The fields that decide the trained weights (for resume checks; excludes eval/cache placement)."""
        d = self.to_dict()
        for k in ("eval_tokens", "eval_seq_len", "cache_dir", "prefetch", "e2e_steps", "e2e_lr", "threads"):
            d.pop(k)
        return d


# Valid values of the numeric fields (flag names where the CLI has one, config keys otherwise).
RANGES = {
    "keep_layers": Int("--keep-layers", 1, MAX_COUNT),
    "train_tokens": Int("--train-tokens", 1, MAX_TOKENS, note="e.g. --train-tokens 16384"),
    "epochs": Int("--epochs", 1, MAX_COUNT, note="e.g. --epochs 4 (four passes over train-tokens / 4 distinct tokens)"),
    "segments": Int("--segments", 1, MAX_COUNT),
    "seq_len": Int("--seq-len", 2, MAX_SEQ),
    "batch_size": Int("--batch-size", 1, MAX_BATCH),
    "lr": Real("--lr", 0.0, 10.0, lo_open=True, note="e.g. --lr 2e-3"),
    "weight_decay": Real("weight_decay", 0.0, 10.0),
    "kl_weight": Real("--kl-weight", 0.0, 1e6),
    "kl_temperature": Real("kl_temperature", 0.0, 1e3, lo_open=True),
    "kl_positions": Real("kl_positions", 0.0, 1.0, lo_open=True),
    "ce_weight": Real("--ce-weight", 0.0, 1e6, note="e.g. --ce-weight 0.5 (0 = pure distillation)"),
    "phase1_fraction": Real("--phase1-fraction", 0.0, 1.0, note="e.g. --phase1-fraction 0.5"),
    "mix_start": Real("mix_start", 0.0, 1.0),
    "mix_end": Real("mix_end", 0.0, 1.0),
    "e2e_steps": Int("--e2e-steps", 0, MAX_COUNT, note="0 turns the end-to-end phase off"),
    "e2e_lr": Real("--e2e-lr", 0.0, 10.0, lo_open=True, note="e.g. --e2e-lr 5e-4"),
    "prefetch": Int("prefetch", 0, 64),
    "eval_tokens": Int("--eval-tokens", 0, MAX_TOKENS, note="0 skips the report's perplexities"),
    "eval_seq_len": Int("eval_seq_len", 2, MAX_SEQ),
    "seed": Int("--seed", 0, MAX_SEED),
    "threads": Int("--threads", 1, MAX_THREADS),
    "grad_rank": Int("--grad-rank", 1, 1024, note="PowerSGD's rank, e.g. --grad-rank 8"),
    "grad_rank_min": Int("--grad-rank-min", 1, 1024, note="EDGC's lowest rank, e.g. --grad-rank-min 2"),
    "grad_rank_max": Int("--grad-rank-max", 1, 1024, note="EDGC's highest (starting) rank, e.g. --grad-rank-max 32"),
    "grad_warmup": Int("--grad-warmup", 2, MAX_COUNT, note="dense steps before PowerSGD/EDGC compress (DDP rebuilds buckets at step 1)"),
    "grad_entropy_span": Real("--grad-entropy-span", 0.0, 1.0, lo_open=True,
                              note="EDGC's entropy drop (share of its peak) from the highest to the lowest rank, e.g. 0.1"),
    "act_rank": act_options.RANK,
    "act_budget": act_options.BUDGET,
}


def config_from_dict(d: dict[str, Any], base: DistillConfig | None = None) -> DistillConfig:
    """A copy of `base` with the fields of `d` set; unknown keys are errors."""
    return spec.config_from_dict(DistillConfig, d, base)


def load_spec(path: Path) -> DistillConfig:
    """Load a YAML spec (a mapping of DistillConfig fields)."""
    return spec.load_spec(DistillConfig, path, "searches/distill-default.yaml")
