"""Layer streaming: run a model larger than memory one decoder layer at a time.

The model's skeleton is built with accelerate's `init_empty_weights` (parameters on the meta device take no
memory; buffers such as rotary frequencies stay real). The token embedding, final norm and head are read
from the checkpoint's safetensors files once; each decoder layer's tensors are read (safetensors `safe_open`,
memory-mapped) when the layer runs over the whole calibration batch, then put back on the meta device. At
any time memory holds the runtime, the embedding and head, one layer and the batch's hidden states.

Why a runner here and not accelerate's disk offload (`device_map=..., offload_folder=...`): offload hooks
re-read every layer for every forward call, i.e. once per batch, and the engines need per-layer control
(Hessian hooks for GPTQ, two boundary states at once for Block Influence). Loading a tensor into the
skeleton is accelerate's `set_module_tensor_to_device`; the layer forward is the model's own (through
`io.forward.run_layers`), so streamed and in-memory runs compute the same operations.

`LayerRunner` has the same interface for a model already in memory (nothing loaded or freed), so an engine
written against it (GPTQ layer by layer, Block Influence, perplexity) runs unchanged either way.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from llmcompress.errors import UserError
from llmcompress.io.adapters import get_adapter

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


class _Stop(Exception):
    pass


# ---------------------------------------------------------------- memory budget


def parse_memory(text: str | int | None) -> int | None:
    """`--max-memory` in bytes: "8GiB", "500MB", a plain number of bytes; None stays None (the default).
    Uses accelerate's size parser; 0 is allowed (always stream)."""
    if text is None:
        return None
    from accelerate.utils import convert_file_size_to_int

    s = str(text).strip()
    if s.isdigit():
        return int(s)
    try:
        value = convert_file_size_to_int(s)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"--max-memory {text!r} is not a memory size", "pass e.g. 8GiB, 500MB or 0 (always stream)")
    return value


def available_memory(device=None) -> int:
    """Bytes free for a model on `device`: free GPU memory on CUDA, else psutil's available host memory."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def safetensors_headers(path: Path):
    """(file, header) for each safetensors file of the checkpoint at `path`, in name order: the JSON header
    (tensor name -> dtype, shape, offsets; `__metadata__` dropped), read without touching the weights."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        header.pop("__metadata__", None)
        yield f, header


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def checkpoint_bytes_at(path: Path, dtype) -> int:
    """Bytes the checkpoint at `path` takes in memory at `dtype` (from the safetensors headers only)."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return sum(numel(v["shape"]) * size for _, header in safetensors_headers(path) for v in header.values())


def streamable_dir(spec: str) -> Path | None:
    """The safetensors directory a model spec streams from (an HF directory or a converted alias/GGUF);
    None for sources that cannot be streamed (zipped checkpoints, hub ids, pickle weights)."""
    from llmcompress.io.load import converted_alias_dir, converted_gguf_dir, resolve

    kind, where = resolve(spec)
    if kind == "dir":
        path = Path(where)
    elif kind == "alias":
        path = converted_alias_dir(str(where))
        if path is None:
            return None
    elif kind == "gguf":
        path = converted_gguf_dir(Path(where))
    else:
        return None
    return path if list(path.glob("*.safetensors")) else None


def should_stream(spec: str, dtype, device=None, max_memory: int | None = None, *, what: str = "") -> Path | None:
    """The directory to stream `spec` from when its weights at `dtype` exceed `max_memory` (default: what
    the device has available), else None. Says so on stderr when it switches."""
    path = streamable_dir(spec)
    if path is None:
        if max_memory == 0:
            raise UserError(f"{spec} cannot be streamed layer by layer (only safetensors checkpoints can)",
                            "pass a Hugging Face directory with *.safetensors, or drop --max-memory 0")
        return None
    need = checkpoint_bytes_at(path, dtype)
    budget = available_memory(device) if max_memory is None else max_memory
    if need <= budget:
        return None
    print(f"notice: {spec} needs {need / 2**30:.2f} GiB at {str(dtype).replace('torch.', '')}, above the memory budget of "
          f"{budget / 2**30:.2f} GiB{' (--max-memory)' if max_memory is not None else ' (available memory)'}: "
          f"streaming its layers from disk one at a time{(' for ' + what) if what else ''}", file=sys.stderr)
    return path


def check_fits(spec: str, dtype, device=None, *, what: str, budget: int | None = None, fix: str | None = None) -> None:
    """For an engine that holds the whole model (`what`: nas's supernet, distill's teacher and student): refuse
    in one line (UserError, exit 2, before anything is written) a model whose weights at `dtype` alone exceed
    `budget` bytes (default: the memory `device` has available), instead of loading for minutes and being killed
    by the kernel. A model not (yet) on disk as safetensors is not checked."""
    path = streamable_dir(spec)
    if path is None:
        return
    need = checkpoint_bytes_at(path, dtype)
    have = available_memory(device) if budget is None else budget
    if need > have:
        raise UserError(f"{spec} needs {need / 2**30:.2f} GiB at {str(dtype).replace('torch.', '')}, more than the "
                        f"{have / 2**30:.2f} GiB {'available' if budget is None else 'of --max-memory'}, and {what} holds the whole model",
                        fix or "use a machine or GPU with more memory (collapse, eval, distill --mode layerwise and export "
                        "--to compressed-tensors stream models larger than memory)")


# ---------------------------------------------------------------- the runner


class LayerRunner:
    """Runs a causal LM layer by layer over a batch of hidden states.

    In memory (`LayerRunner(model)`): the layers are the model's own. Streamed (`LayerRunner.open(path)`):
    the model is a meta-device skeleton and `layer(i)` loads layer i from the safetensors files and frees it
    on exit. Either way:

        h = runner.embed(blocks)                 # list of per-batch hidden states
        for i in range(runner.n_layers):
            with runner.layer(i) as layer:
                h = [runner.run(i, layer, x) for x in h]
        logits = runner.logits(h[0])
    """

    def __init__(self, model: nn.Module, *, files: dict[str, Path] | None = None, keys: dict[str, str] | None = None,
                 device=None, dtype=None, batch: int = 2) -> None:
        import torch

        self.model = model
        self.adapter = get_adapter(model)
        self.files = files  # None: in memory; else checkpoint key -> file
        self.keys = keys or {}  # model tensor name -> checkpoint key
        self.device = torch.device(device) if device is not None else next(p.device for p in model.parameters() if p.device.type != "meta")
        self.dtype = dtype
        self.batch = batch
        self._release = None  # streamed: restores the malloc setting (_mmap_large_tensors)

    @property
    def streamed(self) -> bool:
        return self.files is not None

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def config(self):
        return self.model.config

    # -------------------------------------------------------- building a streamed runner

    @classmethod
    def open(cls, path: Path, *, dtype=None, device="cpu", batch: int = 2, trust_remote_code: bool = False) -> LayerRunner:
        """A streamed runner over the safetensors checkpoint at `path` (HF directory)."""
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from llmcompress.io.load import check_model_dir, quiet_transformers

        quiet_transformers()
        path = Path(path)
        check_model_dir(path)
        dtype = dtype or torch.float32
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        model.eval()
        if (path / "generation_config.json").is_file():  # the checkpoint's own (eos ids, sampling), as from_pretrained reads it
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(str(path))
        files = _index(path)
        keys = _key_map(model, files)
        runner = cls(model, files=files, keys=keys, device=device, dtype=dtype, batch=batch)
        _mmap_large_tensors(runner)
        runner._load_resident()
        return runner

    def _keep_source_dtype(self, name: str, value) -> bool:
        """The token embedding and the head stay in the checkpoint's dtype when it is narrower than the
        compute dtype (a bf16 checkpoint computed in float32: half the bytes of the largest resident
        tensor); `embed` and `logits` widen what they produce, so the values are those of float32."""
        import torch

        big = {f"{self.adapter.embed}.weight", f"{self.adapter.lm_head}.weight"}
        return (name in big and self.dtype is not None and value.is_floating_point()
                and torch.finfo(value.dtype).bits < torch.finfo(self.dtype).bits)

    def _load(self, names: list[str]) -> None:
        """Read the tensors `names` from their files into the skeleton (on the device, in the compute dtype).
        Each file is opened for this call only: an open safetensors handle keeps its memory map, and the
        pages read through it would stay resident (and counted) until it closes. Tried and not kept
        (bench_stream.py gelaco-stream, 2026-12-06, one run each): opening the file per tensor (peak 1.34 vs
        1.26-1.28 GB) and plain reads without a memory map (1.27 GB, wall 170 vs 132 s)."""
        by_file: dict[Path, dict[str, str]] = {}
        for name in names:
            by_file.setdefault(self.files[self.keys[name]], {})[name] = self.keys[name]
        for f, group in by_file.items():
            self.load_from(f, group)

    def load_from(self, file: Path, keys: dict[str, str]) -> None:
        """Read the tensors `keys` (model tensor name -> key in `file`) from the safetensors `file` into the
        skeleton (on the device, in the compute dtype); the file is opened for this call only."""
        from accelerate.utils import set_module_tensor_to_device
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as h:
            for name, key in keys.items():
                value = h.get_tensor(key)
                set_module_tensor_to_device(self.model, name, self.device, value=value, dtype=self._dtype_for(name, value))
                del value

    def read_tensor(self, name: str) -> torch.Tensor:
        """The parameter `name` (a model FQN) as `layer` would load it (compute dtype, on the device), read
        from its file on its own: the file is opened for this tensor only, so nothing else stays mapped."""
        from safetensors import safe_open

        with safe_open(str(self.files[self.keys[name]]), framework="pt", device="cpu") as h:
            value = h.get_tensor(self.keys[name])
        dtype = self._dtype_for(name, value)
        if dtype is None and value.is_floating_point():  # as accelerate casts it: to the skeleton's dtype
            dtype = self.model.get_parameter(name).dtype
        return value.to(device=self.device, dtype=dtype)

    def _dtype_for(self, name: str, value) -> torch.dtype | None:
        """The dtype a floating tensor is loaded in: the checkpoint's where `_keep_source_dtype`, else the
        compute dtype (None: accelerate casts it to the skeleton's); None for integer tensors."""
        if not value.is_floating_point():
            return None
        return value.dtype if self._keep_source_dtype(name, value) else self.dtype

    def layer_prefix(self, i: int) -> str:
        return f"{self.adapter.layers}.{i}."

    def _load_resident(self) -> None:
        """Everything outside the decoder layers (embedding, final norm, head, position embeddings); ties the
        head to the embedding when the checkpoint stores it once; real buffers go to the device."""
        layers_prefix = self.adapter.layers + "."
        names = [n for n in self.keys if not n.startswith(layers_prefix)]
        self._load(names)
        head = self.adapter.head(self.model)
        if head.weight.device.type == "meta":  # tied and stored once
            if not getattr(self.model.config, "tie_word_embeddings", False):
                raise UserError(f"the checkpoint has no {self.adapter.lm_head}.weight and the model does not tie it",
                                "check the checkpoint is complete")
            head.weight = self.adapter.embeddings(self.model).weight
        for module in self.model.modules():
            for bname, buf in list(module._buffers.items()):
                if buf is not None and buf.device.type != "meta" and buf.device != self.device:
                    module._buffers[bname] = buf.to(self.device)
        missing = [n for n, p in self.model.named_parameters() if p.device.type == "meta" and not n.startswith(layers_prefix)]
        if missing:
            raise UserError(f"the checkpoint has no tensor for {missing[0]}", "check the checkpoint is complete")

    # -------------------------------------------------------- the interface

    def layer_tensor_names(self, i: int) -> list[str]:
        prefix = self.layer_prefix(i)
        return [n for n in self.keys if n.startswith(prefix)]

    @contextmanager
    def layer(self, i: int):
        """Decoder layer i, ready to run; streamed: loaded now, freed (back to meta) on exit."""
        layer = self.adapter.decoder_layers(self.model)[i]
        if not self.streamed:
            yield layer
            return
        names = self.layer_tensor_names(i)
        if not names:
            raise UserError(f"the checkpoint has no tensors for decoder layer {i}", "check the checkpoint is complete")
        try:
            self._load_layer(i, names)
            yield layer
        finally:
            from accelerate.utils import set_module_tensor_to_device

            for name in names:
                set_module_tensor_to_device(self.model, name, "meta")
            return_freed_memory()

    def _load_layer(self, i: int, names: list[str]) -> None:
        """Load decoder layer i's tensors `names` (a subclass may read them from elsewhere)."""
        self._load(names)

    def embed(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """Input of decoder layer 0 for `blocks` (n, T), as a list of per-batch tensors (`self.batch` blocks each).
        The model's own forward computes it (embedding, position embeddings); it stops before layer 0."""
        import torch

        layer0 = self.adapter.decoder_layers(self.model)[0]
        got = {}

        def grab(module, args, kwargs):
            got["h"] = args[0] if args else kwargs["hidden_states"]
            raise _Stop

        out = []
        hook = layer0.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                for b in blocks.split(self.batch):
                    try:
                        self.model(input_ids=b.to(self.device), use_cache=False)
                    except _Stop:
                        pass
                    h = got.pop("h")
                    out.append(h.to(self.dtype) if self.dtype is not None and h.is_floating_point() else h)
        finally:
            hook.remove()
        return out

    def run(self, i: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The output of decoder layer i (the module `layer`) for the boundary state `hidden`."""
        import torch

        from llmcompress.io.forward import run_layers

        with torch.no_grad():
            return run_layers(self.model, hidden, [layer], [i], output="hidden")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits from the last layer's output: final norm, then the head."""
        import torch

        head = self.adapter.head(self.model)
        with torch.no_grad():
            x = self.adapter.norm(self.model)(hidden)
            return head(x) if head.weight.dtype == x.dtype else widened_linear(x, head.weight, getattr(head, "bias", None))

    def close(self) -> None:
        """Nothing stays open between layers; a streamed runner gives back its malloc setting now rather
        than when it is collected."""
        if self._release is not None:
            self._release()


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 8192) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a weight narrower than `x` (a resident head kept in the checkpoint's dtype,
    see `LayerRunner._keep_source_dtype`): widened `rows` output rows at a time, so only a slice is ever held in
    `x`'s dtype. Differentiable in `x` (not in the weight): the backward widens the slices again instead of
    keeping them (autograd would otherwise save every widened slice, i.e. the whole head in `x`'s dtype)."""
    global _WIDENED
    if _WIDENED is None:
        _WIDENED = _widened_function()
    return _WIDENED.apply(x, weight, bias, rows)


_WIDENED = None


def _widened_function():
    import torch
    import torch.nn.functional as F

    def slices(weight, bias, rows, dtype):
        for a in range(0, weight.shape[0], rows):
            yield weight[a : a + rows].to(dtype), None if bias is None else bias[a : a + rows].to(dtype)

    class Widened(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, rows):
            ctx.save_for_backward(weight)
            ctx.rows = rows
            return torch.cat([F.linear(x, w, b) for w, b in slices(weight, bias, rows, x.dtype)], dim=-1)

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            gx = None
            for a, (w, _) in zip(range(0, weight.shape[0], ctx.rows), slices(weight, None, ctx.rows, grad.dtype)):
                part = grad[..., a : a + ctx.rows] @ w
                gx = part if gx is None else gx + part
            return gx, None, None, None

    return Widened


def compute_head(runner: LayerRunner):
    """The runner's head as a module that computes in the compute dtype: the head itself, or, kept narrower (see
    `LayerRunner._keep_source_dtype`), a module that applies it through `widened_linear` (for an engine that runs
    the head itself, e.g. distill's logit KL, with gradients to its input)."""
    import torch.nn as nn

    head = runner.adapter.head(runner.model)
    if runner.dtype is None or head.weight.dtype == runner.dtype:
        return head

    class WidenedHead(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return widened_linear(x, self.inner.weight, getattr(self.inner, "bias", None))

    return WidenedHead(head)


def return_freed_memory() -> None:
    """Give freed heap pages back to the OS after a layer is dropped (glibc's malloc keeps them otherwise,
    and a streamed run's resident memory creeps up layer by layer). No-op where there is no glibc."""
    import ctypes

    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None

# glibc's malloc: tensors above its mmap threshold get their own mapping, unmapped (given back to the OS) on
# free; smaller ones come from the heap, whose freed middle pages stay resident. The threshold is dynamic
# by default: freeing an mmapped chunk raises it to that chunk's size, up to DEFAULT_MMAP_THRESHOLD_MAX
# (32 MiB on 64-bit), so after the first layer is freed a layer's tensors (4-50 MB) land on the heap and a
# streamed run's resident memory keeps the freed layers and Hessians. While a streamed runner lives, the
# threshold is 4 MiB; when the last one is collected it goes to glibc's maximum (mallopt cannot give the
# dynamic behaviour back; a process-wide 4 MiB threshold made an allocation-heavy loop 1.4x slower).
_M_MMAP_THRESHOLD = -3
_STREAM_MMAP_THRESHOLD = 4 * 2**20
_GLIBC_MMAP_THRESHOLD_MAX = 4 * 2**20 * 8  # DEFAULT_MMAP_THRESHOLD_MAX: 4 * 1024 * 1024 * sizeof(long)
_MALLOPT = None
_LIVE_RUNNERS = 0


def _mallopt():
    """glibc's mallopt, or None (not Linux, or another libc such as musl)."""
    import ctypes
    import platform

    global _MALLOPT
    if _MALLOPT is None:
        _MALLOPT = False
        if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
            try:
                _MALLOPT = ctypes.CDLL("libc.so.6").mallopt
            except (OSError, AttributeError):
                pass
    return _MALLOPT or None


def _restore_mmap_threshold(value: int) -> None:
    global _LIVE_RUNNERS
    _LIVE_RUNNERS -= 1
    fn = _mallopt()
    if _LIVE_RUNNERS == 0 and fn is not None:
        fn(_M_MMAP_THRESHOLD, value)


def _mmap_large_tensors(runner) -> None:
    """A 4 MiB mmap threshold while `runner` lives (see above); no-op where there is no glibc."""
    import weakref

    global _LIVE_RUNNERS
    fn = _mallopt()
    if fn is None:
        return
    if _LIVE_RUNNERS == 0:
        fn(_M_MMAP_THRESHOLD, _STREAM_MMAP_THRESHOLD)
    _LIVE_RUNNERS += 1
    runner._release = weakref.finalize(runner, _restore_mmap_threshold, _GLIBC_MMAP_THRESHOLD_MAX)


def _index(path: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file, from the shard index when there is one."""
    from safetensors import safe_open

    idx = path / "model.safetensors.index.json"
    if idx.is_file():
        return {k: path / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})  # noqa: SIM118 - safe_open handles are not mappings
    return out


def _key_map(model, files: dict[str, Path]) -> dict[str, str]:
    """Model tensor name (parameters and persistent buffers) -> checkpoint key. Checkpoints written without
    the base model prefix (old GPT-2 files: "h.0..." for "transformer.h.0...") are matched too."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = {}
    for name in model.state_dict(keep_vars=True):
        if name in files:
            out[name] = name
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in files:
            out[name] = name[len(prefix) + 1 :]
    return out


def open_runner(model_or_path, *, dtype=None, device="cpu", batch: int = 2) -> LayerRunner:
    """A LayerRunner: in memory for an nn.Module, streamed for a checkpoint directory."""
    if isinstance(model_or_path, (str, Path)):
        return LayerRunner.open(Path(model_or_path), dtype=dtype, device=device, batch=batch)
    return LayerRunner(model_or_path, batch=batch)


# ---------------------------------------------------------------- engines over a runner


def boundary_walk(runner: LayerRunner, blocks: torch.Tensor, on_layer=None, description: str = "layers"):
    """Run `blocks` through every layer; `on_layer(i, inputs, outputs)` sees each layer's per-batch input
    and output states. Returns the last layer's output states (list of per-batch tensors)."""
    from llmcompress.progress import track

    hidden = runner.embed(blocks)
    for i in track(range(runner.n_layers), description, total=runner.n_layers):
        with runner.layer(i) as layer:
            out = [runner.run(i, layer, h) for h in hidden]
        if on_layer is not None:
            on_layer(i, hidden, out)
        hidden = out
    return hidden


def streamed_nll(runner: LayerRunner, blocks: torch.Tensor, description: str = "perplexity") -> tuple[float, int]:
    """Sum of next-token NLLs over (n, T) blocks and the number of scored tokens, as
    `eval.perplexity.nll_of_blocks` computes them (each block on its own), layer by layer. The head runs one
    block at a time, so the logits in memory are those of one block."""
    import torch
    import torch.nn.functional as F

    hidden = boundary_walk(runner, blocks, description=description)
    total, count = 0.0, 0
    for h, x in zip(hidden, blocks.split(runner.batch)):
        x = x.to(runner.device)
        for j in range(h.shape[0]):
            logits = runner.logits(h[j : j + 1]).float()
            total += F.cross_entropy(logits[0, :-1], x[j, 1:], reduction="sum").item()
            count += x.shape[1] - 1
        del logits
    torch.cuda.empty_cache() if runner.device.type == "cuda" else None
    return total, count


def block_influence_layerwise(runner: LayerRunner, blocks: torch.Tensor) -> list[float]:
    """Block Influence of every layer (as `metrics.block_influence` on the boundary states) computed one layer at
    a time: only a layer's input and output states are held, and a streamed runner reads one layer from disk
    at a time, so a model larger than memory can be scored."""
    import torch
    import torch.nn.functional as F

    scores: list[float] = []

    def on_layer(i, inputs, outputs):
        cos = torch.cat([F.cosine_similarity(x.float(), y.float(), dim=-1) for x, y in zip(inputs, outputs)])
        scores.append(float(1.0 - cos.mean()))

    boundary_walk(runner, blocks, on_layer, description="block influence")
    return scores


def runner_perplexity(runner: LayerRunner, tokenizer, data: str = "wikitext2", *, split: str | None = None, seq_len: int = 512,
                      max_tokens: int | None = 16384) -> dict:
    """`eval.perplexity.perplexity` over a LayerRunner (the same blocks, each scored on its own)."""
    from llmcompress.eval.perplexity import check_seq_len, perplexity_blocks, perplexity_result

    check_seq_len(runner.model, seq_len)
    blocks = perplexity_blocks(tokenizer, data, split=split, seq_len=seq_len, max_tokens=max_tokens)
    nll, n = streamed_nll(runner, blocks, description=f"ppl {data} (streamed)")
    return perplexity_result(nll, n, blocks, data, split)


def streamed_perplexity(path: Path, tokenizer, data: str = "wikitext2", *, split: str | None = None, seq_len: int = 512,
                        max_tokens: int | None = 16384, batch_size: int = 4, dtype=None, device="cpu") -> dict:
    """`eval.perplexity.perplexity` for the checkpoint at `path`, streamed layer by layer."""
    runner = LayerRunner.open(path, dtype=dtype, device=device, batch=batch_size)
    try:
        return runner_perplexity(runner, tokenizer, data, split=split, seq_len=seq_len, max_tokens=max_tokens)
    finally:
        runner.close()


def open_streamed(spec: str, path: Path, *, dtype=None, device="cpu", batch: int = 2):
    """(LoadedModel over a streamed skeleton, its LayerRunner) for the model `spec` streamed from the safetensors
    directory `path` (`should_stream`'s answer): the tokenizer, the source's hash (a converted alias or GGUF
    records the file it came from) and dtype, as `io.load.load_model` gives them for a model in memory."""
    from transformers import AutoTokenizer

    from llmcompress.io.dtypes import detect_source_dtype
    from llmcompress.io.load import LoadedModel, resolve

    runner = LayerRunner.open(path, dtype=dtype, device=device, batch=batch)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    source = Path(path) / "source.json"
    source_hash = json.loads(source.read_text()).get("sha256", "") if source.is_file() else ""
    kind, where = resolve(spec)
    lm = LoadedModel(runner.model, tok, str(spec), runner.adapter, source_hash, {}, detect_source_dtype(kind, where))
    return lm, runner


def write_streamed(skeleton: nn.Module, layers, tokenizer, out: Path, manifest: dict, *, compute_dtype, dtype: str | None = None,
                   overwrite: bool = False) -> Path:
    """Write a checkpoint one decoder layer at a time, as `io.checkpoint.save_checkpoint` writes a model in memory.

    `skeleton`: the output model with its decoder layers on the meta device (its config, names and resident
    tensors: embedding, final norm, head); `layers.layer(i)`: a context manager yielding decoder layer i with its
    weights (e.g. a LayerRunner). Each layer is written as its own shard and freed, the resident tensors in a last
    shard, with `model.safetensors.index.json` mapping every tensor to its shard (the sharded layout transformers
    reads). Tensors, config, manifest fields and `weights_sha256` (hashed in `compute_dtype`, state-dict order)
    equal those `save_checkpoint` writes from the same model in memory. `dtype`: the saved floating dtype
    (None: `compute_dtype`)."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from llmcompress.io.atomic import atomic_dir, write_json
    from llmcompress.io.checkpoint import finish_checkpoint, set_config_dtype
    from llmcompress.io.dtypes import dtype_name, torch_dtype
    from llmcompress.metrics import update_tensor_digest

    compute = compute_dtype or torch.float32
    saved = torch_dtype(dtype) if dtype is not None else compute
    adapter = get_adapter(skeleton)
    n = skeleton.config.num_hidden_layers
    shard = [f"model-{k + 1:05d}-of-{n + 1:05d}.safetensors" for k in range(n + 1)]
    layers_prefix = adapter.layers + "."
    head = f"{adapter.lm_head}.weight"
    tied = bool(getattr(skeleton.config, "tie_word_embeddings", False))
    digest = hashlib.sha256()
    weight_map: dict[str, str] = {}
    rest: dict[str, torch.Tensor] = {}

    def on_disk(t):
        return (t.detach().to(saved) if t.is_floating_point() else t.detach()).contiguous()

    state = skeleton.state_dict()
    done: set[int] = set()
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        for name, t in state.items():  # state-dict order: the order `weights_hash` reads
            if name.startswith(layers_prefix):
                g = int(name[len(layers_prefix) :].split(".", 1)[0])
                if g in done:
                    continue
                done.add(g)
                prefix = f"{layers_prefix}{g}."
                tensors = {}
                with layers.layer(g) as layer:
                    for rel, v in layer.state_dict().items():
                        update_tensor_digest(digest, v, label=f"{prefix}{rel}:")
                        tensors[prefix + rel] = on_disk(v)
                save_file(tensors, str(tmp / shard[g]), metadata={"format": "pt"})
                weight_map.update({k: shard[g] for k in tensors})
                del tensors
                continue
            # a resident tensor kept narrower than the compute dtype (see LayerRunner) is hashed as computed
            update_tensor_digest(digest, t.to(compute) if t.is_floating_point() and t.dtype != compute else t, label=f"{name}:")
            if not (tied and name == head):
                rest[name] = on_disk(t)
        save_file(rest, str(tmp / shard[n]), metadata={"format": "pt"})
        weight_map.update({k: shard[n] for k in rest})
        nbytes = sum((tmp / f).stat().st_size for f in shard)
        write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": nbytes}, "weight_map": weight_map})
        skeleton.config.architectures = [type(skeleton).__name__]
        skeleton.config.save_pretrained(tmp)
        set_config_dtype(tmp / "config.json", dtype_name(saved))
        if skeleton.can_generate():
            skeleton.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        finish_checkpoint(tmp, manifest, name=Path(out).name, layers=n, parameters=sum(p.numel() for p in skeleton.parameters()),
                          dtype=dtype_name(saved), weights_sha256=digest.hexdigest())
    return Path(out)


__all__ = ["LayerRunner", "available_memory", "block_influence_layerwise", "boundary_walk", "check_fits", "checkpoint_bytes_at", "compute_head",
           "open_runner", "open_streamed", "parse_memory", "return_freed_memory", "runner_perplexity", "safetensors_headers", "should_stream",
           "streamable_dir", "streamed_nll", "streamed_perplexity", "widened_linear", "write_streamed"]
