"""Where text comes from: named datasets (local data directory first, then the hub), plain files, `self`.

Named datasets and their splits:
  wikitext2: `test` = raw test (`wiki.test.raw`, for evaluation); `valid` = tokenized valid detokenized
             back to plain text (for calibration). There is no train split here.
  tinyshakespeare: `train` = first 90% of characters, `valid` = last 10%, `all`.
  piqa: `valid` = goal + correct solution, as plain text (the lm-eval task reads the jsonl itself).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from llmcompress.errors import DataError
from llmcompress.paths import data_dir


@dataclass(frozen=True)
class NamedDataset:
    name: str
    files: dict[str, str]  # split -> path relative to the data directory
    hub: tuple[str, str | None] | None  # (hub id, config) used when the local files are missing
    default_split: str


DATASETS: dict[str, NamedDataset] = {
    "wikitext2": NamedDataset(
        "wikitext2",
        {"test": "wikitext-2/wiki.test.raw", "valid": "wikitext-2/valid.txt", "test-tokenized": "wikitext-2/test.txt"},
        ("Salesforce/wikitext", "wikitext-2-raw-v1"),
        "test",
    ),
    "tinyshakespeare": NamedDataset(
        "tinyshakespeare",
        {"all": "tinyshakespeare/input.txt", "train": "tinyshakespeare/input.txt", "valid": "tinyshakespeare/input.txt"},
        None,
        "valid",
    ),
    "piqa": NamedDataset("piqa", {"valid": "piqa/piqa_validation.jsonl"}, ("ybisk/piqa", None), "valid"),
}

_PUNCT_BEFORE = re.compile(r" ([.,;:!?)\]}'])")
_PUNCT_AFTER = re.compile(r"([(\[{]) ")


def detokenize_wikitext(text: str) -> str:
    """Undo WikiText's tokenization: ` @-@ ` -> `-`, ` @,@ ` -> `,`, ` @.@ ` -> `.`, no space before punctuation."""
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    text = text.replace(" 's", "'s").replace(" n't", "n't").replace(" 're", "'re").replace(" 've", "'ve")
    text = text.replace(" 'm", "'m").replace(" 'll", "'ll").replace(" 'd", "'d")
    text = _PUNCT_BEFORE.sub(r"\1", text)
    text = _PUNCT_AFTER.sub(r"\1", text)
    text = text.replace(" \n", "\n")
    return text


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text", "pass a UTF-8 .txt or .jsonl file") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", "check the path and its permissions") from None


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    for i, line in enumerate(_read(path).splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{path}:{i + 1} is not valid JSON", "each line of a .jsonl file must be one JSON object") from None
        if isinstance(rec, str):
            texts.append(rec)
        elif "text" in rec:
            texts.append(str(rec["text"]))
        elif "goal" in rec and "sol1" in rec:  # PIQA record: question + correct answer
            sol = rec.get("sol2") if rec.get("label") == 1 else rec.get("sol1")
            texts.append(f"Question: {rec['goal']}\nAnswer: {sol}")
        else:
            raise DataError(f"{path}:{i + 1} has no 'text' field", "give each JSON line a 'text' field")
    return texts


def _split_named(ds: NamedDataset, split: str, raw: str) -> str:
    if ds.name == "wikitext2" and split == "valid":
        return detokenize_wikitext(raw)
    if ds.name == "tinyshakespeare":
        cut = int(len(raw) * 0.9)
        return {"train": raw[:cut], "valid": raw[cut:]}.get(split, raw)
    return raw


def hub_reachable(timeout: float = 2.0) -> bool:
    """False when offline mode is set or the hub's host cannot be reached quickly (no retries)."""
    import os
    import socket

    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(ds: NamedDataset, split: str) -> str:
    if ds.hub is None:
        raise DataError(f"dataset {ds.name!r} is not in the data directory {data_dir()}", how_to_get(ds.name))
    if not hub_reachable():
        raise DataError(
            f"dataset {ds.name!r} is not in {data_dir()} and the hub is unreachable",
            f"{how_to_get(ds.name)}, or use --data self",
        )
    try:
        import datasets

        hub_split = {"valid": "validation"}.get(split, split)
        d = datasets.load_dataset(ds.hub[0], ds.hub[1], split=hub_split)
    except Exception as exc:  # offline, missing, ... : one clear line
        raise DataError(
            f"dataset {ds.name!r} is not in {data_dir()} and the hub is unreachable ({type(exc).__name__})",
            "set LLMCOMPRESS_DATA_DIR to a folder holding it, or use --data self",
        ) from None
    if ds.name == "piqa":
        return "\n\n".join(f"Question: {r['goal']}\nAnswer: {r['sol2' if r['label'] == 1 else 'sol1']}" for r in d)
    return "".join(r["text"] for r in d)


def is_named(source: str) -> bool:
    """A known dataset name, or one registered with `llmcompress data add`."""
    from llmcompress.data.catalog import read_registry

    return source in DATASETS or (source != "self" and source in read_registry())


def local_file(name: str, split: str) -> Path | None:
    """The local file that holds `split` of a named dataset (registered path first, then the data
    directory's layout), or None when it is not on this machine."""
    from llmcompress.data.catalog import registered_file

    reg = registered_file(name, split)
    if reg is not None or name not in DATASETS:
        return reg
    path = data_dir() / DATASETS[name].files[split]
    return path if path.is_file() else None


def dataset_available(name: str) -> bool:
    """True when every split of a named dataset is on this machine, or the hub has it and is reachable."""
    from llmcompress.data.catalog import read_registry

    ds = DATASETS.get(name)
    splits = ds.files if ds else read_registry().get(name, {})
    if splits and all(local_file(name, split) is not None for split in splits):
        return True
    return ds is not None and ds.hub is not None and hub_reachable()


def how_to_get(name: str) -> str:
    """One line: how a user provides the named dataset."""
    if DATASETS[name].hub is None:
        return f"run `llmcompress data add {name} PATH` with a local copy, or set LLMCOMPRESS_DATA_DIR to a folder holding it"
    return f"run `llmcompress data fetch {name}` (online), or set LLMCOMPRESS_DATA_DIR to a folder holding it"


def load_texts(source: str, split: str | None = None) -> list[str]:
    """Return a list of documents for a named dataset (`wikitext2`, `tinyshakespeare`, `piqa`) or a file.

    Raises DataError with a one-line message when the source cannot be found, read or is empty.
    `self` is handled by `calibration_blocks` (it needs the model).
    """
    if is_named(source):
        from llmcompress.data.catalog import default_split, read_registry

        ds = DATASETS.get(source)
        split = split or (ds.default_split if ds else default_split(source))
        splits = ds.files if ds else read_registry()[source]
        if split not in splits:
            raise DataError(f"dataset {source!r} has no split {split!r}", f"use one of {', '.join(splits)}")
        path = local_file(source, split)
        if path is not None:
            texts = _jsonl_texts(path) if path.suffix == ".jsonl" else [_split_named(ds, split, _read(path)) if ds else _read(path)]
        elif ds is not None:
            texts = [_from_hub(ds, split)]
        else:
            raise DataError(
                f"dataset {source!r} is registered at {read_registry()[source][split]}, which is missing",
                f"run `llmcompress data add {source} PATH` again",
            )
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(
                f"unknown dataset or missing file {source!r}",
                f"use one of {', '.join([*DATASETS, 'self'])} (`llmcompress data list`), or a path to a .txt or .jsonl file",
            )
        if path.is_dir():
            raise DataError(f"{path} is a directory", "pass a .txt or .jsonl file")
        texts = _jsonl_texts(path) if path.suffix == ".jsonl" else [_read(path)]
    if not any(t.strip() for t in texts):
        raise DataError(f"data source {source!r} is empty", "pass a file with text in it")
    return texts
