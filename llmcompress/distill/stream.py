"""distill with a teacher larger than memory: the layer-wise phases over decoder layers streamed from disk.

When the teacher's float32 weights are above the memory budget (`--max-memory`; default: what the machine
has), `distill --mode layerwise` reads them one decoder layer at a time (io/stream.py) instead of loading them:

- Block Influence selection (`--select bi`) and the report's perplexities run over a `LayerRunner`.
- Teacher features (`build_teacher_cache_streamed`): the same shards as `cache.build_teacher_cache`, computed
  one layer at a time over a chunk of training batches, each layer read once per chunk; a chunk's states
  (the working pair in float32 and every cached boundary) take at most a quarter of the memory budget.
- The student (`StudentRunner`): a skeleton whose decoder layer i is real only while its segment trains,
  propagates, is scored or is saved; it is read from its source (the teacher's layer `keep[i]`, or the
  `--student` checkpoint) until a segment file in OUT/work holds its trained weights, then from that file.
  A removal student shares the teacher runner's resident embedding, final norm and head. Memory holds
  the runtime, the embedding and head, one segment's layers with their optimiser state, and a chunk or batch.
- The saved student: `io.stream.write_streamed`, one layer per shard.

The phases' arithmetic is the in-memory engine's (engine.py calls the same functions, inside
`Run.materialized(segment)`), so a streamed run trains the same student as one in memory (to float rounding:
a streamed layer computes what the model's own forward does, see io/stream.py). What needs the whole
student at once is refused before anything is written: `--mode e2e`, `--e2e-steps` and `--data self`.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from llmcompress.errors import UserError
from llmcompress.io.stream import LayerRunner

if TYPE_CHECKING:
    import torch

    from llmcompress.distill.config import DistillConfig
    from llmcompress.distill.segments import Segment


def whole_model_needs(cfg: DistillConfig) -> list[str]:
    """The options of `cfg` that run the whole student (or teacher) at once, so cannot be streamed."""
    from llmcompress.distill.config import Mode

    needs = []
    if cfg.mode == Mode.E2E:
        needs.append("--mode e2e")
    if cfg.e2e_steps > 0:
        needs.append("--e2e-steps")
    if any(part.split(":")[0].strip() == "self" for part in str(cfg.data).split(",")):
        needs.append("--data self")
    return needs


def check_streamable(cfg: DistillConfig, why: str) -> None:
    """One line (UserError) when the run must stream (`why`) but asks for something that needs the whole model."""
    needs = whole_model_needs(cfg)
    if needs:
        raise UserError(f"{why}, and {' and '.join(needs)} need{'s' if len(needs) == 1 else ''} the whole model in memory",
                        "use --mode layerwise without --e2e-steps and with text data (streamed layer by layer), or more memory")


def layer_bytes(path: Path, dtype_bytes: int = 4) -> dict[int, int]:
    """Bytes of each decoder layer of the safetensors checkpoint at `path` at `dtype_bytes` per value, from the
    files' headers (layer i: the tensors named `...layers.i.` or, GPT-2, `...h.i.`)."""
    import re

    from llmcompress.io.stream import numel, safetensors_headers

    pattern = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
    out: dict[int, int] = {}
    for _, header in safetensors_headers(path):
        for name, info in header.items():
            if m := pattern.search(name):
                out[int(m.group(1))] = out.get(int(m.group(1)), 0) + numel(info["shape"]) * dtype_bytes
    return out


def segment_need(n_student: int, segments: int | None, per_layer: int) -> tuple[int, int]:
    """(bytes, layers) of the largest segment while it trains: its float32 weights, their gradients and AdamW's
    two moments (4 copies), for `n_student` student layers in `segments` groups (None: one per layer)."""
    import math

    largest = math.ceil(n_student / (segments or n_student))
    return 4 * largest * per_layer, largest


def check_streamed_run(cfg: DistillConfig, path: Path, budget: int) -> None:
    """Before anything is written, for a run whose teacher streams from `path`: the `--student` checkpoint must
    stream too (safetensors), and the largest segment must train within `budget` bytes (one line otherwise)."""
    from llmcompress.io.stream import streamable_dir

    source = path
    if cfg.student is not None:
        source = streamable_dir(cfg.student)
        if source is None:
            raise UserError(f"the teacher is streamed layer by layer, and so must be the student {cfg.student}, which is not a "
                            "safetensors checkpoint directory", "pass a checkpoint directory with *.safetensors (a collapse output is one)")
    sizes = layer_bytes(source)
    n_student = cfg.keep_layers if cfg.student is None else len(sizes)
    if not sizes or not n_student:
        return
    need, largest = segment_need(n_student, cfg.segments, max(sizes.values()))
    if need > budget:
        fix = (f"use --segments {n_student} (one student layer per segment)" if largest > 1 else "use a machine or GPU with more memory")
        raise UserError(f"a segment of {largest} layer{'s' if largest > 1 else ''} trains with its float32 weights, gradients and "
                        f"AdamW moments ({need / 2**30:.2f} GiB), above the memory budget of {budget / 2**30:.2f} GiB", fix)


class StudentRunner(LayerRunner):
    """A LayerRunner over the student: layer i from its last segment file once trained (`use_segment`), else
    from its source checkpoint (the teacher's files under remapped keys, or the student checkpoint's own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: dict[int, tuple[Path, str]] = {}  # student layer -> (segment file, its key prefix)
        self.parent: LayerRunner | None = None  # the teacher runner whose resident tensors a removal student shares

    @classmethod
    def removal(cls, teacher: LayerRunner, keep: list[int]) -> StudentRunner:
        """The teacher with only the layers `keep`: a skeleton sharing the teacher runner's resident tensors,
        student layer i read from the teacher's layer keep[i]."""
        from llmcompress.io.surgery import keep_layers, shared_copy

        skeleton = keep_layers(shared_copy(teacher.model), keep)  # config, layer_idx and layer_types as in memory
        prefix = teacher.adapter.layers + "."
        student_of = {t: s for s, t in enumerate(keep)}
        keys = {}
        for name, key in teacher.keys.items():
            if not name.startswith(prefix):
                keys[name] = key
                continue
            t, rest = name[len(prefix) :].split(".", 1)
            if int(t) in student_of:
                keys[f"{prefix}{student_of[int(t)]}.{rest}"] = key
        runner = cls(skeleton, files=teacher.files, keys=keys, device=teacher.device, dtype=teacher.dtype, batch=teacher.batch)
        runner.parent = teacher
        return runner

    def use_segment(self, file: Path, first: int, count: int) -> None:
        """Student layers first..first+count-1 are read from `file` from now on (keys "j.<name>", j = 0..count-1,
        as engine.py writes a segment)."""
        for j in range(count):
            self.trained[first + j] = (Path(file), f"{j}.")

    def _load_layer(self, i: int, names: list[str]) -> None:
        source = self.trained.get(i)
        if source is None:
            super()._load_layer(i, names)
            return
        file, prefix = source
        start = len(self.layer_prefix(i))
        self.load_from(file, {name: prefix + name[start:] for name in names})

    @contextmanager
    def segment(self, seg: Segment):
        """The segment's decoder layers real (loaded now, back on the meta device on exit)."""
        with ExitStack() as stack:
            for i in range(seg.student_start, seg.student_end):
                stack.enter_context(self.layer(i))
            yield


def chunk_batches(n_batches: int, batch_tokens: int, hidden: int, n_boundaries: int, cache_bytes: int, budget: int) -> int:
    """Training batches per chunk of the streamed teacher pass: the chunk's float32 working pair (a layer's input
    and output) and its cached boundary states take at most a quarter of `budget` bytes; at least one batch."""
    per_batch = batch_tokens * hidden * (2 * 4 + n_boundaries * cache_bytes)
    return max(1, min(n_batches, (budget // 4) // max(1, per_batch)))


def build_teacher_cache_streamed(
    runner: LayerRunner, blocks: torch.Tensor, boundaries: list[int], *, key: str, root: Path, batch_size: int, dtype: str,
    precision: str = "fp32", budget: int,
):
    """`cache.build_teacher_cache` over a streamed teacher: the same shards (one per training batch, the same
    micro-batches of `runner.batch` blocks), computed layer by layer over chunks of batches (`chunk_batches`);
    layers past the last boundary are never read."""
    import torch

    from llmcompress.distill.cache import FeatureCache, torch_dtype
    from llmcompress.progress import track
    from llmcompress.runtime import autocast

    cache = FeatureCache(root)
    if cache.is_complete(key):
        return cache
    tdtype = torch_dtype(dtype)
    n_batches = len(blocks) // batch_size
    per_chunk = chunk_batches(n_batches, batch_size * blocks.shape[1], runner.config.hidden_size, len(boundaries),
                              torch.empty((), dtype=tdtype).element_size(), budget)
    slot = {b: j for j, b in enumerate(boundaries)}
    last = max(boundaries)

    def shards():
        for c in track(range(0, n_batches, per_chunk), "caching teacher features (streamed)", total=-(-n_batches // per_chunk)):
            batches = range(c, min(n_batches, c + per_chunk))
            hidden, owner = [], []
            for b in batches:
                parts = runner.embed(blocks[b * batch_size : (b + 1) * batch_size])
                hidden += parts
                owner += [b] * len(parts)
            kept: dict[int, list] = {}
            if 0 in slot:
                kept[0] = [h.to("cpu", tdtype) for h in hidden]
            for i in range(last):
                with runner.layer(i) as layer, autocast(runner.device, precision):
                    hidden = [runner.run(i, layer, h) for h in hidden]
                if i + 1 in slot:
                    kept[i + 1] = [h.to("cpu", tdtype) for h in hidden]
            del hidden
            for b in batches:
                mine = [p for p, o in enumerate(owner) if o == b]
                yield {"ids": blocks[b * batch_size : (b + 1) * batch_size].clone(),
                       **{f"b{slot[bd]}": torch.cat([kept[bd][p] for p in mine]) for bd in boundaries}}

    cache.write(shards(), key=key, meta={"boundaries": boundaries, "dtype": dtype})
    return cache


def files_key(path: Path) -> list:
    """What identifies a streamed checkpoint for the feature cache's key without reading its weights: its
    resolved path and each safetensors file's name, size, modification time and header (tensor names, shapes,
    dtypes and offsets)."""
    from llmcompress.io.stream import safetensors_headers

    path = Path(path).resolve()
    return [str(path)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns, header] for f, header in safetensors_headers(path)]


def ppl_streamed(runner: LayerRunner, tokenizer, cfg: DistillConfig) -> float | None:
    """`run.eval_ppl` over a LayerRunner (the same WikiText-2 blocks, layer by layer)."""
    if cfg.eval_tokens <= 0 or tokenizer is None:
        return None
    from llmcompress.io.stream import runner_perplexity

    return runner_perplexity(runner, tokenizer, "wikitext2", seq_len=cfg.eval_seq_len, max_tokens=cfg.eval_tokens)["ppl"]


__all__ = ["StudentRunner", "build_teacher_cache_streamed", "check_streamable", "check_streamed_run", "chunk_batches", "files_key",
           "layer_bytes", "ppl_streamed", "segment_need", "whole_model_needs"]
