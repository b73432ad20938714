"""The state one distillation run shares between its phases (engine.py) and the end-to-end loops (e2e.py).

Kept apart from both so that neither imports the other's private names (engine.py calls into e2e.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcompress.dist import DistInfo
from llmcompress.distill.cache import FeatureCache
from llmcompress.distill.config import DistillConfig
from llmcompress.distill.segments import Segment
from llmcompress.eval.report import STUDENT_BEFORE, TEACHER, WIKITEXT2_PPL, role_key
from llmcompress.io.atomic import append_jsonl, write_json


@dataclass
class Run:
    """What the phases share: config, model, layout, caches, paths, state."""

    cfg: DistillConfig
    out: Path
    dist: DistInfo
    device: Any
    model: Any = None
    tokenizer: Any = None
    segments: list[Segment] = field(default_factory=list)
    teacher: FeatureCache | None = None
    norm: Any = None  # the teacher's frozen final norm and head (logit KL targets)
    head: Any = None
    state: dict = field(default_factory=dict)
    log_buffer: list = field(default_factory=list)
    comm: Any = None  # the data-parallel e2e loop's gradient compression (comm/edgc.py GradCompression)
    streamed: Any = None  # distill/stream.py StudentRunner when the teacher is streamed layer by layer (larger than memory)

    @property
    def work(self) -> Path:
        return self.out / "work"

    def layers(self, seg: Segment) -> list:
        from llmcompress.io.adapters import get_adapter

        return list(get_adapter(self.model).decoder_layers(self.model))[seg.student_start : seg.student_end]

    def materialized(self, seg: Segment):
        """A context in which the segment's layers are real: always in memory; streamed, loaded for it."""
        from contextlib import nullcontext

        return nullcontext() if self.streamed is None else self.streamed.segment(seg)

    def log(self, record: dict) -> None:
        if self.dist.is_main:
            append_jsonl(self.out / "train_log.jsonl", record)
        else:
            self.log_buffer.append(record)

    def autocast(self):
        """Forward passes of training, propagation and caching run under this (cfg.precision)."""
        from llmcompress.runtime import autocast

        return autocast(self.device, self.cfg.precision.value)

    def save_state(self) -> None:
        if self.dist.is_main:
            write_json(self.work / "state.json", self.state)


# the report's perplexity keys (eval/report.py's vocabulary): the student's own unprefixed, the teacher's and the
# untrained student's under their roles
TEACHER_PPL, BEFORE_PPL = role_key(TEACHER, WIKITEXT2_PPL), role_key(STUDENT_BEFORE, WIKITEXT2_PPL)


def eval_ppl(model, tokenizer, cfg: DistillConfig) -> float | None:
    """WikiText-2 perplexity for the report, through the eval module (None when eval_tokens is 0)."""
    if cfg.eval_tokens <= 0 or tokenizer is None:
        return None
    from llmcompress.eval.report import measure, wikitext2_spec

    return measure(model, tokenizer, wikitext2_spec(cfg.eval_tokens, cfg.eval_seq_len))[WIKITEXT2_PPL]
