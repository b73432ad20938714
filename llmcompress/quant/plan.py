"""`MixedPrecisionPlan`: an ordered map from module FQN (or `re:<regex>`, or `_default`) to a `QuantConfig`.

Modelled on torchao's `FqnToConfig`: exact FQNs win, then the first matching `re:` key, then `_default`;
a `None` config means "leave this module in floating point". The plan is JSON-serialisable and goes into
checkpoint manifests.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

from llmcompress.quant.primitives import MAX_BITS, MIN_BITS


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only group-wise uniform quantization of one linear layer (asymmetric unless `sym`)."""

    bits: int = 4
    group_size: int = 64
    method: str = "rtn"  # rtn | gptq
    version: int = 1
    sym: bool = False  # symmetric: zero fixed at 2**(bits-1) (see primitives)

    def __post_init__(self) -> None:
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}")
        if self.group_size <= 0:
            raise ValueError(f"group size must be positive, got {self.group_size}")

    def to_dict(self) -> dict:
        d = {"bits": self.bits, "group_size": self.group_size, "method": self.method}
        if self.sym:
            d["sym"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        allowed = {"bits", "group_size", "method", "version", "sym"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"unknown QuantConfig keys {sorted(unknown)}")
        return cls(**d)


@dataclass
class MixedPrecisionPlan:
    """Ordered FQN -> QuantConfig | None map (keys: exact FQN, "re:<regex>", "_default")."""

    entries: OrderedDict[str, QuantConfig | None] = field(default_factory=OrderedDict)
    version: int = 1

    def __setitem__(self, key: str, cfg: QuantConfig | None) -> None:
        self.entries[key] = cfg

    def __len__(self) -> int:
        return len(self.entries)

    def config_for(self, fqn: str) -> QuantConfig | None:
        if fqn in self.entries:
            return self.entries[fqn]
        for key, cfg in self.entries.items():
            if key.startswith("re:") and re.fullmatch(key[3:], fqn):
                return cfg
        return self.entries.get("_default")

    def quantized(self, fqns) -> dict[str, QuantConfig]:
        """The modules among `fqns` the plan quantizes, in order."""
        out = {}
        for f in fqns:
            cfg = self.config_for(f)
            if cfg is not None:
                out[f] = cfg
        return out

    def to_dict(self) -> dict:
        return {"version": self.version, "entries": {k: (v.to_dict() if v else None) for k, v in self.entries.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> MixedPrecisionPlan:
        entries = OrderedDict((k, QuantConfig.from_dict(v) if v else None) for k, v in d["entries"].items())
        return cls(entries=entries, version=d.get("version", 1))
