"""`llmcompress zip CKPT --out DIR` and `llmcompress unzip ZIPPED --out DIR`: lossless checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmcompress.cli._options import OutOpt, OverwriteOpt

ThreadsOpt = Annotated[int, typer.Option("--threads", help="Worker threads (0 = one per core, at most 8).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _check_numbers(**values) -> None:
    """Range-check the numeric options given (the same Range checks as the engines' configs)."""
    from llmcompress.spec import MAX_THREADS, Int, check_ranges

    ranges = {
        "threads": Int("--threads", 0, MAX_THREADS, note="pass 0 (one per core) or a positive count"),
        "chunk_kb": Int("--chunk-kb", 4, 65536, note="256-1024 is best"),
    }
    check_ranges(values, {k: ranges[k] for k in values})


def _threads(n: int) -> int:
    from llmcompress.lossless.codec import default_threads

    return n or default_threads()


def _resolve_ckpt(spec: str) -> Path:
    """A checkpoint directory; an alias resolves to its converted cache directory."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    from llmcompress.io import load

    if spec in load.ALIASES:
        cached = load.converted_alias_dir(spec)
        if cached is None:
            from llmcompress.errors import UserError

            raise UserError(f"{spec} has not been converted to safetensors yet", f"run `llmcompress info {spec}` once, then zip it")
        return cached
    return p


def zip_command(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint directory holding *.safetensors files.")],
    out: OutOpt,
    threads: ThreadsOpt = 0,
    chunk_kb: Annotated[int, typer.Option("--chunk-kb", help="Chunk size in KiB (256-1024 recommended).")] = 512,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Compress a checkpoint losslessly (ZipCCL exponent coding); prints ratio and throughput."""
    from llmcompress.io.preflight import check_writable, dir_bytes
    from llmcompress.lossless.container import zip_checkpoint

    _check_numbers(threads=threads, chunk_kb=chunk_kb)
    src = _resolve_ckpt(checkpoint)
    check_writable(out, dir_bytes(src))  # compressed is smaller than the original
    stats = zip_checkpoint(src, out, threads=_threads(threads), chunk_kb=chunk_kb, overwrite=overwrite)
    stats = {"checkpoint": str(checkpoint), "out": str(out), **stats}
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    for dt, v in stats["by_dtype"].items():
        typer.echo(f"{dt:>10}: {v['original_bytes'] / 1e6:10.1f} MB -> {v['compressed_bytes'] / 1e6:10.1f} MB  ratio {v['ratio']:.4f}")
    typer.echo(
        f"{'overall':>10}: {stats['original_bytes'] / 1e6:10.1f} MB -> {stats['compressed_bytes'] / 1e6:10.1f} MB  "
        f"ratio {stats['ratio']:.4f}"
    )
    typer.echo(
        f"throughput: codec {stats['codec_MBps']} MB/s, end to end {stats['wall_MBps']} MB/s "
        f"({stats['threads']} thread(s)); wrote {out}"
    )


def unzip_command(
    zipped: Annotated[str, typer.Argument(help="Directory written by `llmcompress zip`.")],
    out: OutOpt,
    threads: ThreadsOpt = 0,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Restore the safetensors files of a zipped checkpoint, byte for byte."""
    from llmcompress.io.preflight import check_writable, dir_bytes
    from llmcompress.lossless.container import unzip_checkpoint

    _check_numbers(threads=threads)
    check_writable(out, 1.5 * dir_bytes(Path(zipped)))  # ZipCCL keeps ~70% of the bytes: 1.5x is a safe bound
    stats = unzip_checkpoint(Path(zipped), out, threads=_threads(threads), overwrite=overwrite)
    stats = {"zipped": str(zipped), "out": str(out), **stats}
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    typer.echo(f"restored {stats['files']} file(s), {stats['bytes'] / 1e6:.1f} MB at {stats['wall_MBps']} MB/s -> {out}")
