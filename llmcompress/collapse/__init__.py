"""Evolutionary layer collapse (GeLaCo) with a Pareto front of ready checkpoints, plus ShortGPT / LaCo baselines.

Public API:
    CollapseConfig, load_spec     typed config and YAML search specs
    run_collapse(cfg, out_dir)    the whole pipeline behind `llmcompress collapse`
Building blocks: `operator` (merge math), `space` (genome + pymoo operators), `fitness` (prefix-cached
evaluator), `baselines`, `search` (GA / NSGA-II with resume), `export` (checkpoints and reports).
"""

from __future__ import annotations

from llmcompress.collapse.config import METHODS, CollapseConfig, config_from_dict, load_spec
from llmcompress.collapse.pipeline import run_collapse

__all__ = ["METHODS", "CollapseConfig", "config_from_dict", "load_spec", "run_collapse"]
