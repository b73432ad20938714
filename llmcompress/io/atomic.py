"""Atomic writes: write to a temporary sibling, then rename, so readers never see half a file.

The only writer of final files: `write_bytes`/`write_text`/`write_json` for data in hand, `atomic_path` for
writers that want a file name (torch.save, safetensors, np.save, savefig), `atomic_dir` for a directory.
Files are fsynced before the rename; on error the temporary is removed and the old file or directory
stays; results get normal permissions (0666/0777 less the umask), not mkstemp's private 0600/0700.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmcompress.errors import DiskFull, OutputExists, UserError


def check_out_dir(out: Path, overwrite: bool = False, resume: bool = False) -> None:
    """Refuse an existing, non-empty output directory unless told to overwrite or resume."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output path {out} exists and is not a directory", "choose another --out")
    if out.exists() and any(out.iterdir()) and not (overwrite or resume):
        raise OutputExists(f"output directory {out} already exists", "choose another --out, or pass --overwrite")


def normal_mode(directory: bool = False) -> int:
    """The mode a plain open()/mkdir() would give: 0o666 (files) or 0o777 (directories) less the umask.

    mkstemp/mkdtemp create 0600/0700 on purpose (private temp files); a final output must not keep that.
    """
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (setting it to read it back would
    briefly give files created by other threads meanwhile a 0 umask)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_modes(root: Path) -> None:
    """Give every file and folder under `root` the normal mode (symlinks are left alone)."""
    file_mode, dir_mode = normal_mode(), normal_mode(directory=True)
    for dirpath, dirnames, filenames in os.walk(root):
        for name, mode in [(d, dir_mode) for d in dirnames] + [(f, file_mode) for f in filenames]:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, mode)


@contextmanager
def removed_if_left_empty(out: Path) -> Iterator[None]:
    """Around a run that creates `out`: if the run fails before writing anything into it, remove the empty
    `out` it created, so a failed run (bad input) leaves no output directory behind. Never removes content."""
    out = Path(out)
    existed = out.exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


@contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `final` only when the block finishes without error."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise OutputExists(f"{final} already exists", "choose another path, or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(normal_mode(directory=True))
        yield tmp
        _normal_modes(tmp)  # writers inside may use private temp files too (transformers' save_pretrained does)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_disk_full(exc, final)
        raise
    if final.exists():
        trash = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` for a writer that wants a file name (torch.save, safetensors'
    save_file, np.save, savefig); when the block ends without error the file is fsynced, given normal
    permissions and renamed onto `path`, otherwise it is removed and `path` is left as it was.

    The temporary name ends with `path`'s suffix: savefig picks the format from it, np.save appends
    ".npy" to a name without it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.chmod(normal_mode())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        _raise_disk_full(exc, path)
        raise


def _raise_disk_full(exc: BaseException, path: Path) -> None:
    """A full disk while writing `path` becomes one line and exit 2 (the temporary is already removed)."""
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and not isinstance(exc, UserError):
        raise DiskFull(f"no space left on the disk of {path.parent} while writing {path.name}", "free some space or write elsewhere, then rerun") from None


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file atomically: a temporary sibling, fsync, then rename."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def append_jsonl(path: Path, obj) -> None:
    """Append one JSON line and fsync (a crash loses at most the line being written)."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(obj, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        _raise_disk_full(exc, Path(path))
        raise
