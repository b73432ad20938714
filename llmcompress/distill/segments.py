"""Segment layout: which teacher layers each group of student layers replaces (pure, no torch needed).

A *layer map* has one entry per student layer, `{"sources": [teacher layer indices merged into it]}`
(the `collapse` manifest format). A student made by plain removal maps layer i to teacher `keep[i]`.

Fine segments: student layer i replaces the teacher layers from `min(sources[i])` up to the first
source of student layer i+1 (teacher layers that no student layer names belong to the student layer
before them; those before the first named one belong to the first). `S` segments group consecutive
student layers evenly (by student-layer count: those are what is trained).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from llmcompress.errors import UserError


@dataclass(frozen=True)
class Segment:
    """Teacher layers [teacher_start, teacher_end) are replaced by student layers [student_start, student_end)."""

    index: int
    teacher_start: int
    teacher_end: int
    student_start: int
    student_end: int

    @property
    def student_layers(self) -> list[int]:
        return list(range(self.student_start, self.student_end))

    def to_dict(self) -> dict:
        return asdict(self)


def uniform_keep(n_teacher: int, n_keep: int) -> list[int]:
    """`n_keep` evenly spaced teacher layers, always including the first and the last."""
    check_student_size(n_teacher, n_keep)
    if n_keep == 1:
        return [0]
    return sorted({round(i * (n_teacher - 1) / (n_keep - 1)) for i in range(n_keep)})


def bi_keep(scores: Sequence[float], n_keep: int) -> list[int]:
    """Keep the `n_keep` layers with the highest Block Influence (1 - cos(input, output)), in order."""
    check_student_size(len(scores), n_keep)
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(ranked[:n_keep])


def layer_map_from_keep(keep: Sequence[int]) -> list[dict]:
    return [{"sources": [int(k)]} for k in keep]


def check_student_size(n_teacher: int, n_student: int) -> None:
    if n_student >= n_teacher:
        raise UserError(
            f"the student has {n_student} layers and the teacher {n_teacher}: a student must have fewer layers than its teacher",
            f"use --keep-layers {n_teacher - 1} or fewer",
        )
    if n_student < 1:
        raise UserError("a student needs at least one layer", "use --keep-layers 1 or more")


def validate_layer_map(layer_map: Sequence[dict], n_teacher: int) -> list[list[int]]:
    """Return the sources of each student layer; raise UserError if the map does not fit the teacher."""
    check_student_size(n_teacher, len(layer_map))
    sources: list[list[int]] = []
    for i, entry in enumerate(layer_map):
        src = entry.get("sources") if isinstance(entry, dict) else None
        if not src or not all(isinstance(s, int) for s in src):
            raise UserError(f"layer_map entry {i} has no list of teacher 'sources'", "check the student's llmcompress.json")
        bad = [s for s in src if not 0 <= s < n_teacher]
        if bad:
            raise UserError(
                f"layer_map entry {i} names teacher layers {bad}, but the teacher has {n_teacher} layers",
                "distill a student against the teacher it was made from",
            )
        sources.append(sorted(src))
    for i in range(1, len(sources)):
        if sources[i][0] <= sources[i - 1][-1]:
            raise UserError(
                f"layer_map is not in teacher order (student layer {i} starts at teacher layer {sources[i][0]})",
                "student layers must map onto increasing, disjoint teacher layers",
            )
    return sources


def segment_layout(layer_map: Sequence[dict], n_teacher: int, n_segments: int | None = None) -> list[Segment]:
    """Split the teacher into `n_segments` segments (None: one per student layer) matched to student layers."""
    sources = validate_layer_map(layer_map, n_teacher)
    n_student = len(sources)
    s = n_student if n_segments is None else n_segments
    if s < 1:
        raise UserError(f"--segments {s} is too small", "use 1 or more")
    if s > n_student:
        raise UserError(
            f"--segments {s} is more than the student's {n_student} layers (each segment needs a student layer)",
            f"use --segments {n_student} or fewer",
        )
    # fine teacher boundary in front of each student layer
    t_start = [0] + [src[0] for src in sources[1:]]
    s_bounds = [math.floor(g * n_student / s + 0.5) for g in range(s + 1)]
    segs = []
    for g in range(s):
        a, b = s_bounds[g], s_bounds[g + 1]
        t_end = t_start[b] if b < n_student else n_teacher
        segs.append(Segment(g, t_start[a], t_end, a, b))
    return segs


def teacher_boundaries(segments: Sequence[Segment]) -> list[int]:
    """Teacher boundary indices the cache must hold: segment inputs, then the last output."""
    return [seg.teacher_start for seg in segments] + [segments[-1].teacher_end]

