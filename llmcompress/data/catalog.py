"""The data directory's catalog: which named datasets are here, fetching them from the hub, registering local copies.

A user registers a local file or folder under a name with `llmcompress data add NAME PATH`; the registry is
one JSON file in the data directory (`registry.json`: {"datasets": {name: {split: absolute path}}}), read by
the named-dataset resolver in `llmcompress.data.sources`. A registered path wins over the data directory's
own layout, which wins over the hub. Hand-written because `datasets` has no notion of a local catalog of
plain-text corpora under short names; downloads themselves go through `datasets.load_dataset`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmcompress.errors import DataError
from llmcompress.paths import data_dir

REGISTRY = "registry.json"
TEXT_SUFFIXES = (".txt", ".jsonl", ".raw")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")

# what `fetch` downloads for each split: (hub config, hub split); the files keep the data directory's layout
HUB_SPLITS: dict[str, dict[str, tuple[str | None, str]]] = {
    "wikitext2": {
        "test": ("wikitext-2-raw-v1", "test"),
        "valid": ("wikitext-2-raw-v1", "validation"),
        "test-tokenized": ("wikitext-2-v1", "test"),
    },
    "piqa": {"valid": (None, "validation")},
}


def registry_path() -> Path:
    return data_dir() / REGISTRY


def read_registry() -> dict[str, dict[str, str]]:
    """{name: {split: path}} of the registered datasets (empty when nothing was added)."""
    path = registry_path()
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("datasets", {}))
    except (OSError, ValueError, AttributeError):
        raise DataError(f"the data registry {path} is not valid JSON", "fix or delete it, then `llmcompress data add` again") from None


def registered_file(name: str, split: str) -> Path | None:
    entry = read_registry().get(name, {})
    path = entry.get(split)
    return Path(path) if path and Path(path).is_file() else None


def default_split(name: str) -> str:
    """The split a bare custom name reads: `all` when registered, else the first one."""
    splits = list(read_registry().get(name, {}))
    return "all" if "all" in splits else splits[0]


def _check_name(name: str) -> None:
    if name == "self" or not _NAME.fullmatch(name):
        raise DataError(f"{name!r} is not a usable dataset name", "use letters, digits, '_', '-' or '.', starting with a letter (not `self`)")


def add(name: str, path: Path, split: str | None = None) -> dict[str, str]:
    """Register a local file or folder under `name`; returns the {split: path} entry written.

    A known dataset (wikitext2, tinyshakespeare, piqa) given a folder takes, for each of its splits, the file
    of the data directory's layout found in that folder (`wikitext-2/wiki.test.raw` or `wiki.test.raw`);
    given a file, the file serves `split` (default: its default split; every split when all of them share one
    file, as tinyshakespeare's do). Any other name given a folder gets one split per .txt/.jsonl file (named
    after the file); given a file, one split (`split`, default `all`).
    """
    from llmcompress.data.sources import DATASETS
    from llmcompress.io.atomic import write_json

    _check_name(name)
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise DataError(f"{path} does not exist", "pass an existing file or folder")
    ds = DATASETS.get(name)
    entry: dict[str, str] = {}
    if ds is not None:
        if split is not None and split not in ds.files:
            raise DataError(f"dataset {name!r} has no split {split!r}", f"use one of {', '.join(ds.files)}")
        if path.is_dir():
            for s, rel in ds.files.items():
                if split not in (None, s):
                    continue
                for cand in (path / rel, path / Path(rel).name):
                    if cand.is_file():
                        entry[s] = str(cand)
                        break
            if not entry:
                wanted = ", ".join(sorted({Path(rel).name for rel in ds.files.values()}))
                raise DataError(f"{path} holds none of {name}'s files", f"pass a folder with {wanted}, or one file with --split")
        else:
            shared = len(set(ds.files.values())) == 1
            for s in ds.files if (shared and split is None) else [split or ds.default_split]:
                entry[s] = str(path)
    else:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if split is not None:
                files = [p for p in files if p.stem == split]
            if not files:
                raise DataError(f"{path} holds no .txt or .jsonl file", "pass a folder of .txt/.jsonl files, or one file")
            entry = {p.stem: str(p) for p in files}
        else:
            entry = {split or "all": str(path)}
    for p in entry.values():  # readable, non-empty text: fail now rather than at the first run
        from llmcompress.data.sources import load_texts

        load_texts(p)
    registry = read_registry()
    registry[name] = {**(registry.get(name, {}) if ds is not None else {}), **entry}
    write_json(registry_path(), {"datasets": registry})
    return entry


def status() -> list[dict]:
    """One record per named dataset (known and registered): its splits, where each was found, the hub source."""
    from llmcompress.data.sources import DATASETS

    registry = read_registry()
    out = []
    for name in [*DATASETS, *(n for n in registry if n not in DATASETS)]:
        ds = DATASETS.get(name)
        splits = {}
        for split in (ds.files if ds else registry[name]):
            reg = registered_file(name, split)
            local = data_dir() / ds.files[split] if ds else None
            if reg is not None:
                splits[split] = {"found": str(reg), "via": "registry"}
            elif local is not None and local.is_file():
                splits[split] = {"found": str(local), "via": "data dir"}
            else:
                splits[split] = {"found": None, "via": None}
        hub = ds.hub[0] if ds and ds.hub else None
        out.append({"name": name, "splits": splits, "hub": hub, "registered": name in registry})
    return out


def fetch(name: str) -> list[Path]:
    """Download a named dataset from the hub into the data directory (same layout the resolver reads)."""
    from llmcompress.data.sources import DATASETS, how_to_get, hub_reachable
    from llmcompress.io.atomic import write_text
    from llmcompress.progress import track

    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}", f"use one of {', '.join(HUB_SPLITS)}; register other text with `llmcompress data add NAME PATH`")
    ds = DATASETS[name]
    if ds.hub is None or name not in HUB_SPLITS:
        raise DataError(f"dataset {name!r} has no hub source to fetch from", how_to_get(name))
    if not hub_reachable():
        raise DataError(
            f"cannot fetch {name!r}: the hub is unreachable (offline, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set)",
            f"connect and retry, or copy its files here and run `llmcompress data add {name} PATH`",
        )
    import datasets

    written = []
    for split, (config, hub_split) in track(HUB_SPLITS[name].items(), f"fetch {name}"):
        try:
            d = datasets.load_dataset(ds.hub[0], config, split=hub_split)
        except Exception as exc:  # network, missing config, ...: one clear line
            raise DataError(f"fetching {name!r} ({ds.hub[0]}, {hub_split}) failed: {type(exc).__name__}", "retry when the hub is reachable") from None
        path = data_dir() / ds.files[split]
        if path.suffix == ".jsonl":
            text = "".join(json.dumps({k: r[k] for k in ("goal", "sol1", "sol2", "label")}) + "\n" for r in d)
        else:
            text = "".join(r["text"] for r in d)
        write_text(path, text)
        written.append(path)
    return written
