"""`llmcompress nas`: differentiable architecture search jointly with mixed-precision quantization.

See README.md in this folder. Public entry points: `NasConfig`, `run_nas`.
"""

from llmcompress.nas.config import NasConfig, config_from_dict, load_spec


def run_nas(*args, **kwargs):
    from llmcompress.nas.pipeline import run_nas as _run

    return _run(*args, **kwargs)


__all__ = ["NasConfig", "config_from_dict", "load_spec", "run_nas"]
