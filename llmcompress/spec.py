"""Declarative search specs: YAML files of config fields (see `searches/`). Unknown keys are errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from llmcompress.errors import UserError

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any], base: C | None = None) -> C:
    """A copy of `base` (or `cls()`) with the fields of `data` set; unknown keys raise UserError."""
    names = {f.name for f in dataclasses.fields(cls)}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"unknown search-spec key(s): {', '.join(unknown)}", f"allowed keys: {', '.join(sorted(names))}")
    return dataclasses.replace(base if base is not None else cls(), **data)


def load_spec(cls: type[C], path: Path, example: str) -> C:
    """Read a YAML search spec into a config of type `cls`; `example` names a shipped spec for the hint."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise UserError(f"cannot read search spec {path}: {exc.strerror}", "pass an existing YAML file to --spec") from None
    except yaml.YAMLError as exc:
        raise UserError(f"search spec {path} is not valid YAML: {str(exc).splitlines()[0]}", "fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"search spec {path} must be a mapping of keys to values", f"see {example}")
    return config_from_dict(cls, data)
