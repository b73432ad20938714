"""Declarative search specs: YAML files of config fields (see `searches/`). Unknown keys are errors.

Every engine's config is a dataclass that owns its defaults, its choice Enums and its numeric RANGES; the
CLI and `--spec FILE` only set fields (`config_from_dict`), so both meet the same checks (exit 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from llmcompress.errors import UserError

C = TypeVar("C")
E = TypeVar("E", bound=Enum)


def config_from_dict(cls: type[C], data: dict[str, Any], base: C | None = None) -> C:
    """A copy of `base` (or `cls()`) with the fields of `data` set; unknown keys raise UserError."""
    names = {f.name for f in dataclasses.fields(cls)}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"unknown search-spec key(s): {', '.join(unknown)}", f"allowed keys: {', '.join(sorted(names))}")
    return dataclasses.replace(base if base is not None else cls(), **data)


def choice(enum_cls: type[E], value: Any, key: str) -> E:
    """`enum_cls(value)`, or UserError naming the key, the value and the choices (a spec's typo is exit 2)."""
    try:
        return enum_cls(value)
    except ValueError:
        raise UserError(f"unknown {key} {value!r}", f"use one of {', '.join(str(m.value) for m in enum_cls)}") from None


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


# ---------------------------------------------------------------- numeric ranges

# Upper bounds far beyond any real run: they only catch typos and overflows (e.g. an extra "000").
MAX_TOKENS = 10**10
MAX_COUNT = 10**6  # layers, population, generations, steps, examples, blocks
MAX_SEQ = 1 << 20
MAX_BATCH = 1 << 16
MAX_THREADS = 1024
MAX_SEED = 2**32 - 1  # numpy's seed range


@dataclass(frozen=True)
class Range:
    """The valid values of one numeric option: `lo <= value <= hi` (strict where `lo_open`/`hi_open`).

    `flag` is how the user spells it (`--max-tokens`, or a spec key); `note` says what special values
    mean (e.g. "0 skips it"), for the error's fix. `integer` rejects 2.5 (YAML specs are not typed).
    """

    flag: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = True
    note: str = ""

    def text(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return " and ".join(x for x in (lo, hi) if x)

    def check(self, value: Any) -> None:
        """Raise UserError naming the flag, the value and the range (None means "not set" and passes)."""
        if value is None:
            return
        kind = "an integer" if self.integer else "a number"
        ok_type = isinstance(value, int) or (not self.integer and isinstance(value, float))
        if isinstance(value, bool) or not ok_type:
            raise UserError(f"{self.flag} must be {kind} {self.text()} (got {value!r})", self.note or f"pass {kind}")
        ok = (self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)) and (
            self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        )
        if not ok:  # NaN fails every comparison, so it lands here too
            raise UserError(f"{self.flag} must be {self.text()} (got {value!r})", self.note or f"pass a value {self.text()}")


def Int(flag: str, lo: int | None = None, hi: int | None = None, note: str = "") -> Range:
    return Range(flag, lo, hi, integer=True, note=note)


def Real(flag: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False, note: str = "") -> Range:
    return Range(flag, lo, hi, lo_open=lo_open, hi_open=hi_open, integer=False, note=note)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def check_ranges(values: Any, ranges: dict[str, Range]) -> None:
    """Check every named field of `values` (a dataclass instance or a mapping) against its Range.

    The one place numbers are range-checked: each typed config keeps its table next to its fields and
    calls this from `validate()`, so CLI flags and `--spec` files meet the same bounds before any model loads.
    """
    get = values.get if isinstance(values, dict) else lambda k: getattr(values, k)
    for name, rng in ranges.items():
        v = get(name)
        if isinstance(v, (list, tuple)):
            for x in v:
                rng.check(x)
        else:
            rng.check(v)
