"""Zipped checkpoints: every *.safetensors file of a checkpoint becomes one `.llmz` file.

Layout of a `.llmz` file (all integers little-endian; see README.md):

    b"LLMZ" u32 version(=1) u64 index_len  index(JSON, utf-8)  u32 crc32(index)
    then data blocks at the offsets the index names (absolute file offsets):
      - the verbatim safetensors header (8-byte length + JSON) of the source file,
      - per tensor: the ZipCCL chunks (see codec.py), or raw bytes for other dtypes,
      - any bytes of the data region not covered by a tensor (stored raw).

Every block has its crc32 in the index, so a truncated or corrupted file is detected before any
byte is written. `unzip` rebuilds each safetensors file byte for byte.

The directory's `llmz.json` names the files to restore. It carries `index_sha256`, the sha256 of its own
canonical JSON (sorted keys, no spaces) without that field, checked on read; archives written before the
field existed are still read (their names are checked all the same). Every name is checked to be a plain
file name (no '/', no '..', not absolute) and every copied file a regular file inside the archive (no
symlink) before anything is written, so an archive can never write or read outside its directories.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmcompress.errors import UserError
from llmcompress.lossless import codec

MAGIC = b"LLMZ"
VERSION = 1
MANIFEST = "llmz.json"
SUFFIX = ".llmz"
BATCH_BYTES = 256 << 20  # tensors coded per batch (bounds memory)

_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
    "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}  # fmt: skip
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip


def _corrupt(path: Path, what: str) -> UserError:
    return UserError(f"corrupt zipped checkpoint {path}: {what}", "re-create it with `llmcompress zip`")


@dataclass
class ZipStats:
    """Sizes and timings of one zip or unzip run."""

    by_dtype: dict = field(default_factory=dict)  # dtype -> [original bytes, coded bytes]
    files: int = 0
    tensors: int = 0
    codec_seconds: float = 0.0
    wall_seconds: float = 0.0
    threads: int = 1

    def add(self, dtype: str, orig: int, coded: int) -> None:
        d = self.by_dtype.setdefault(dtype, [0, 0])
        d[0] += orig
        d[1] += coded

    def as_dict(self) -> dict:
        orig = sum(v[0] for v in self.by_dtype.values())
        coded = sum(v[1] for v in self.by_dtype.values())
        return {
            "files": self.files,
            "tensors": self.tensors,
            "threads": self.threads,
            "original_bytes": orig,
            "compressed_bytes": coded,
            "ratio": round(coded / orig, 5) if orig else 1.0,
            "by_dtype": {
                k: {"original_bytes": v[0], "compressed_bytes": v[1], "ratio": round(v[1] / v[0], 5) if v[0] else 1.0}
                for k, v in sorted(self.by_dtype.items())
            },
            "codec_seconds": round(self.codec_seconds, 3),
            "wall_seconds": round(self.wall_seconds, 3),
            "codec_MBps": round(orig / 1e6 / self.codec_seconds, 1) if self.codec_seconds > 0 else None,
            "wall_MBps": round(orig / 1e6 / self.wall_seconds, 1) if self.wall_seconds > 0 else None,
        }


# ------------------------------------------------------------------------------------------------
# safetensors parsing
# ------------------------------------------------------------------------------------------------


def _plain_name(name) -> bool:
    """A bare file name: no directory part, not '.', '..' or absolute, nothing a path join could escape with."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name and not os.path.isabs(name))


def index_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of `llmz.json` without its own `index_sha256` field."""
    body = {k: v for k, v in manifest.items() if k != "index_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _NoSpace:
    """Turn 'no space left on device' while writing into a one-line UserError naming the path and the size
    the write needs (the caller's atomic_dir removes the partial output as the error passes through)."""

    def __init__(self, where: Path, needed_bytes: int) -> None:
        self.where, self.needed = where, needed_bytes

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on {self.where} (needs ~{max(1, round(self.needed / 1e6))} MB)",
                            "free some space there or choose another --out") from None
        return False


def _read_st_header(path: Path) -> tuple[bytes, dict, int]:
    """(verbatim header bytes incl. the 8-byte length, parsed JSON, data start)."""
    try:
        with open(path, "rb") as f:
            raw_n = f.read(8)
            if len(raw_n) < 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw_n)
            if n > 100 << 20:
                raise ValueError("header length out of range")
            hb = f.read(n)
            if len(hb) < n:
                raise ValueError("truncated header")
        header = json.loads(hb)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read safetensors file {path}: {exc}", "pass a valid checkpoint") from None
    return raw_n + hb, header, 8 + n


# ------------------------------------------------------------------------------------------------
# zip
# ------------------------------------------------------------------------------------------------


def _tensor_from(buf: np.ndarray, st_dtype: str, shape: list[int]):
    import warnings

    import torch

    name = _ST_DTYPES[st_dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memmap: we never write through the tensor
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf.size else torch.zeros(0, dtype=torch.uint8)
    return t.view(getattr(torch, name)).reshape(shape)


def zip_file(src: Path, dst: Path, threads: int, chunk_bytes: int, stats: ZipStats) -> None:
    """Code one safetensors file into a `.llmz` file."""
    header_bytes, header, data_start = _read_st_header(src)
    size = src.stat().st_size
    mm = np.memmap(src, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = (int(v) for v in meta["data_offsets"])
            dt = meta["dtype"]
            shape = [int(s) for s in meta["shape"]]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"malformed safetensors header in {src} (tensor {name})", "pass a valid checkpoint") from None
        if data_start + b > size or a > b:
            raise UserError(f"truncated safetensors file {src} (tensor {name})", "re-create or re-download it")
        entries.append((a, b, name, dt, shape))
    entries.sort()
    index: dict = {"version": VERSION, "source": src.name, "source_size": size, "blocks": [], "tensors": []}
    blocks: list = []  # (kind, info dict, list of byte buffers)

    # header and gaps as raw blocks
    blocks.append(({"kind": "st_header", "length": len(header_bytes)}, [header_bytes]))
    pos = data_start
    gaps = []
    for a, b, *_ in entries:
        if data_start + a > pos:
            gaps.append((pos, data_start + a))
        pos = max(pos, data_start + b)
    if size > pos:
        gaps.append((pos, size))
    for g0, g1 in gaps:
        blocks.append(({"kind": "gap", "start": g0, "length": g1 - g0}, [bytes(mm[g0:g1])]))

    # tensors in batches
    batch: list = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        tensors = []
        for a, b, _name, dt, shape in batch:
            if dt in _ST_DTYPES and math_prod(shape) * _ITEMSIZE[dt] == b - a:
                tensors.append(_tensor_from(np.asarray(mm[data_start + a : data_start + b]), dt, shape))
            else:
                tensors.append(None)
        coded_in = [t for t in tensors if t is not None]
        t0 = time.perf_counter()
        encs = iter(codec.encode_many(coded_in, chunk_bytes=chunk_bytes, threads=threads))
        stats.codec_seconds += time.perf_counter() - t0
        for (a, b, name, dt, _shape), t in zip(batch, tensors):
            if t is None:  # unknown dtype or inconsistent shape: keep the bytes as they are
                info = {"kind": "raw_tensor", "name": name, "start": data_start + a, "length": b - a}
                blocks.append((info, [bytes(mm[data_start + a : data_start + b])]))
                stats.add(dt, b - a, b - a)
                continue
            enc = next(encs)
            info = {
                "kind": "tensor",
                "name": name,
                "start": data_start + a,
                "length": b - a,
                "dtype": enc.dtype,
                "shape": list(enc.shape),
                "chunk_values": enc.chunk_values,
                "sigma": float(enc.sigma),
                "model_lengths": "".join(f"{int(v):x}" for v in enc.model_lengths) if enc.model_lengths is not None else None,
            }
            bufs = [enc.chunk(c) for c in range(enc.nchunks)]
            blocks.append((info, bufs))
            stats.add(enc.dtype, b - a, enc.nbytes)
            stats.tensors += 1
        batch, batch_bytes = [], 0

    for e in entries:
        batch.append(e)
        batch_bytes += e[1] - e[0]
        if batch_bytes >= BATCH_BYTES:
            flush()
    flush()

    # layout: compute offsets after the index, which we must size first -> two passes
    def build_index(base: int) -> bytes:
        off = base
        out = []
        for info, bufs in blocks:
            chunks = []
            for bb in bufs:
                ln = len(bb) if isinstance(bb, bytes) else int(bb.shape[0])
                chunks.append([off, ln, zlib.crc32(bb) & 0xFFFFFFFF])
                off += ln
            out.append({**info, "chunks": chunks})
        index["blocks"] = out
        return json.dumps(index, separators=(",", ":")).encode()

    crcs_cache = None
    ib = build_index(0)
    for _ in range(3):  # offsets depend on the index length; iterate to a fixed point
        base = 16 + len(ib) + 4
        ib2 = build_index(base)
        if len(ib2) == len(ib):
            ib = ib2
            break
        ib = ib2
    else:  # pad to a stable length
        base = 16 + len(ib) + 4 + 64
        ib = build_index(base)
        ib = ib + b" " * (base - 20 - len(ib))
    del crcs_cache
    with open(dst, "wb") as f:
        f.write(MAGIC + struct.pack("<IQ", VERSION, len(ib)))
        f.write(ib)
        f.write(struct.pack("<I", zlib.crc32(ib) & 0xFFFFFFFF))
        for _info, bufs in blocks:
            for bb in bufs:
                f.write(bb if isinstance(bb, bytes) else memoryview(bb))
    stats.files += 1


def math_prod(shape) -> int:
    p = 1
    for s in shape:
        p *= int(s)
    return p


def _checkpoint_files(src: Path) -> tuple[list[Path], list[Path]]:
    if not src.exists():
        raise UserError(f"{src} does not exist", "pass a checkpoint directory holding *.safetensors files")
    if not src.is_dir():
        raise UserError(f"{src} is not a directory", "pass a checkpoint directory holding *.safetensors files")
    if (src / MANIFEST).is_file():
        raise UserError(f"{src} is already zipped", "unzip it with `llmcompress unzip`")
    st = sorted(p for p in src.iterdir() if p.is_file() and p.suffix == ".safetensors")
    if not st:
        raise UserError(f"{src} is not a checkpoint (no *.safetensors files)", "pass a Hugging Face model directory")
    other = sorted(p for p in src.iterdir() if p.is_file() and p.suffix != ".safetensors")
    return st, other


def zip_checkpoint(
    src: Path, out: Path, *, threads: int = 1, chunk_kb: int = 512, overwrite: bool = False
) -> dict:
    """Compress a checkpoint directory into `out` (atomically). Returns statistics (see ZipStats)."""
    from llmcompress.io.atomic import atomic_dir, check_out_dir, write_json

    src, out = Path(src), Path(out)
    st_files, others = _checkpoint_files(src)
    check_out_dir(out, overwrite=overwrite)
    if not 4 <= chunk_kb <= 65536:
        raise UserError(f"--chunk-kb {chunk_kb} out of range", "use a value between 4 and 65536 (256-1024 is best)")
    stats = ZipStats(threads=threads)
    t0 = time.perf_counter()
    needed = sum(p.stat().st_size for p in st_files + others)  # an upper bound: coded files are smaller
    with atomic_dir(out, overwrite=True) as tmp, _NoSpace(out.resolve().parent, needed):
        files = []
        for p in st_files:
            zip_file(p, tmp / (p.name + SUFFIX), threads, chunk_kb * 1024, stats)
            files.append({"name": p.name, "llmz": p.name + SUFFIX, "size": p.stat().st_size})
        for p in others:
            shutil.copy2(p, tmp / p.name)
        stats.wall_seconds = time.perf_counter() - t0
        manifest = {"format": "llmz", "version": VERSION, "codec": "zipccl-1", "chunk_kb": chunk_kb, "files": files,
                    "copied": [p.name for p in others], "stats": stats.as_dict()}  # fmt: skip
        write_json(tmp / MANIFEST, {**manifest, "index_sha256": index_digest(manifest)})
    return stats.as_dict()


# ------------------------------------------------------------------------------------------------
# unzip
# ------------------------------------------------------------------------------------------------


def _read_index(path: Path, buf: np.ndarray) -> dict:
    if buf.shape[0] < 20 or bytes(buf[:4]) != MAGIC:
        raise _corrupt(path, "bad magic (not an .llmz file)")
    ver, n = struct.unpack("<IQ", bytes(buf[4:16]))
    if ver != VERSION:
        raise _corrupt(path, f"unsupported version {ver}")
    if 16 + n + 4 > buf.shape[0]:
        raise _corrupt(path, "truncated index")
    ib = bytes(buf[16 : 16 + n])
    (crc,) = struct.unpack("<I", bytes(buf[16 + n : 20 + n]))
    if zlib.crc32(ib) & 0xFFFFFFFF != crc:
        raise _corrupt(path, "index checksum mismatch")
    try:
        return json.loads(ib)
    except ValueError:
        raise _corrupt(path, "unreadable index") from None


def _verify(path: Path, buf: np.ndarray, index: dict, threads: int) -> None:
    size = buf.shape[0]
    items = []
    for blk in index["blocks"]:
        for off, ln, crc in blk["chunks"]:
            if off < 0 or off + ln > size:
                raise _corrupt(path, f"truncated (block {blk.get('name', blk['kind'])} ends past the file)")
            items.append((off, ln, crc))

    def check(it) -> bool:
        off, ln, crc = it
        return zlib.crc32(buf[off : off + ln]) & 0xFFFFFFFF == crc

    ok = codec.run_tasks([lambda it=it: check(it) for it in items], threads) if threads > 1 else [check(it) for it in items]
    if not all(ok):
        bad = sum(1 for v in ok if not v)
        raise _corrupt(path, f"{bad} block(s) fail their crc32 checksum")


def _decode_file(path: Path, threads: int, want_tensors: bool):
    """Verify and decode one .llmz file: (index, buf, {name: tensor} or None)."""
    try:
        buf = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc}", "check the path") from None
    index = _read_index(path, buf)
    try:
        _verify(path, buf, index, threads)
        encs, names = [], []
        for blk in index["blocks"]:
            if blk["kind"] != "tensor":
                continue
            offs = [c[0] for c in blk["chunks"]]
            base = offs[0] if offs else 0
            ends = [c[0] + c[1] for c in blk["chunks"]]
            payload = buf[base : ends[-1]] if offs else np.zeros(0, np.uint8)
            offsets = np.array([o - base for o in offs] + [(ends[-1] - base) if offs else 0], np.int64)
            ml = blk.get("model_lengths")
            lm = np.array([int(ch, 16) for ch in ml], np.int64) if ml else None
            encs.append(codec.Encoded(blk["dtype"], tuple(blk["shape"]), blk["chunk_values"], payload, offsets, lm, blk["sigma"]))
            names.append(blk["name"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise _corrupt(path, f"malformed index ({type(exc).__name__}: {str(exc)[:80]})") from None
    try:
        tensors = codec.decode_many(encs, threads=threads)
    except (codec.CorruptData, ValueError) as exc:
        raise _corrupt(path, str(exc)) from None
    return index, buf, dict(zip(names, tensors))


def _read_manifest(src: Path) -> dict:
    """`llmz.json`, checked: its checksum, its shape, and that every name is a plain file of the archive."""
    m = src / MANIFEST
    if not m.is_file():
        raise UserError(f"{src} is not a zipped checkpoint (no {MANIFEST})", "pass a directory written by `llmcompress zip`")
    try:
        manifest = json.loads(m.read_text())
    except (ValueError, UnicodeDecodeError):
        raise _corrupt(src, f"unreadable {MANIFEST}") from None
    if not isinstance(manifest, dict):
        raise _corrupt(src, f"{MANIFEST} is not a JSON object")
    if "index_sha256" in manifest and manifest["index_sha256"] != index_digest(manifest):
        raise _corrupt(src, f"{MANIFEST} fails its checksum (index_sha256)")
    files, copied = manifest.get("files", []), manifest.get("copied", [])
    if not isinstance(files, list) or not isinstance(copied, list):
        raise _corrupt(src, f"malformed {MANIFEST} ('files' and 'copied' must be lists)")
    names = []
    for fe in files:
        if not isinstance(fe, dict) or not isinstance(fe.get("size", 0), int):
            raise _corrupt(src, f"malformed {MANIFEST} entry {str(fe)[:80]!r}")
        for key in ("name", "llmz"):
            if not _plain_name(fe.get(key)):
                raise _corrupt(src, f"{MANIFEST} names {str(fe.get(key))[:80]!r}, not a plain file name")
        names.append(fe["name"])
    for name in copied:
        if not _plain_name(name):
            raise _corrupt(src, f"{MANIFEST} names {str(name)[:80]!r}, not a plain file name")
        p = src / name
        if p.is_symlink() or (p.exists() and not p.is_file()):
            raise _corrupt(src, f"{name} is a link or not a regular file")
    dup = {n for n in names + list(copied) if (names + list(copied)).count(n) > 1}
    if dup:
        raise _corrupt(src, f"{MANIFEST} names {sorted(dup)[0]!r} twice")
    for fe in files:
        if (src / fe["llmz"]).is_symlink():
            raise _corrupt(src, f"{fe['llmz']} is a link")
    return manifest


def unzip_checkpoint(src: Path, out: Path, *, threads: int = 1, overwrite: bool = False) -> dict:
    """Restore the safetensors files (byte for byte) and the copied files of a zipped checkpoint."""
    from llmcompress.io.atomic import atomic_dir, check_out_dir

    src, out = Path(src), Path(out)
    if not src.exists():
        raise UserError(f"{src} does not exist", "pass a directory written by `llmcompress zip`")
    manifest = _read_manifest(src)
    check_out_dir(out, overwrite=overwrite)
    t0 = time.perf_counter()
    total = 0
    needed = sum(int(fe.get("size", 0)) for fe in manifest.get("files", [])) + sum(
        (src / n).stat().st_size for n in manifest.get("copied", []) if (src / n).is_file())
    with atomic_dir(out, overwrite=True) as tmp, _NoSpace(out.resolve().parent, needed):
        for fe in manifest.get("files", []):
            p = src / fe["llmz"]
            if not p.is_file():
                raise _corrupt(src, f"missing {fe['llmz']}")
            index, buf, tensors = _decode_file(p, threads, True)
            try:
                size = int(index["source_size"])
                if "size" in fe and size != fe["size"]:
                    raise _corrupt(src, f"{fe['llmz']} restores {size} bytes, {MANIFEST} says {fe['size']}")
                res = np.zeros(size, np.uint8)
                for blk in index["blocks"]:
                    if blk["kind"] == "st_header":
                        off, ln, _ = blk["chunks"][0]
                        res[:ln] = buf[off : off + ln]
                    elif blk["kind"] == "tensor":
                        t = tensors[blk["name"]]
                        if blk["length"]:
                            res[blk["start"] : blk["start"] + blk["length"]] = t.reshape(-1).view(__import__("torch").uint8).numpy()
                    else:  # gap / raw_tensor
                        pos = blk["start"]
                        for off, ln, _ in blk["chunks"]:
                            res[pos : pos + ln] = buf[off : off + ln]
                            pos += ln
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                raise _corrupt(p, f"malformed index ({type(exc).__name__}: {str(exc)[:80]})") from None
            with open(tmp / fe["name"], "wb") as f:
                f.write(memoryview(res))
            total += size
        for name in manifest.get("copied", []):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
    wall = time.perf_counter() - t0
    return {"files": len(manifest.get("files", [])), "bytes": total, "wall_seconds": round(wall, 3),
            "wall_MBps": round(total / 1e6 / wall, 1) if wall > 0 else None}  # fmt: skip


def load_state_dict(path: Path, threads: int | None = None) -> dict:
    """Decode every tensor of a zipped checkpoint: {name: tensor}."""
    path = Path(path)
    manifest = _read_manifest(path)
    threads = threads or codec.default_threads()
    sd: dict = {}
    for fe in manifest.get("files", []):
        p = path / fe["llmz"]
        if not p.is_file():
            raise _corrupt(path, f"missing {fe['llmz']}")
        index, buf, tensors = _decode_file(p, threads, True)
        sd.update(tensors)
        for blk in index["blocks"]:
            if blk["kind"] == "raw_tensor":
                raise UserError(f"tensor {blk['name']} has an unsupported layout", "unzip the checkpoint and load that")
    return sd


def load_zipped_model(path: Path, dtype=None):
    """Build the HF model from config.json and the decoded state dict; returns (model, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    sd = load_state_dict(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = dtype or torch.float32
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        # non-persistent buffers (rotary inv_freq) are rebuilt by a real-device init of those modules
        real = AutoModelForCausalLM.from_config(config, dtype=dtype)
        real_bufs = dict(real.named_buffers())
        real_params = dict(real.named_parameters())
        for n in still_meta:
            mod_name, _, attr = n.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            if n in real_bufs:
                mod._buffers[attr] = real_bufs[n]
            elif n in real_params:
                raise _corrupt(path, f"tensor {n} missing from the zipped checkpoint")
    model = model.to(dtype).eval()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    return model, tok
