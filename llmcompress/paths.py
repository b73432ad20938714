"""Where llmcompress keeps its cache and finds its data."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """User cache directory (LLMCOMPRESS_CACHE_DIR overrides)."""
    env = os.environ.get("LLMCOMPRESS_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("llmcompress"))


def data_dir() -> Path:
    """Local data directory (LLMCOMPRESS_DATA_DIR overrides; default under the cache directory)."""
    env = os.environ.get("LLMCOMPRESS_DATA_DIR")
    return Path(env) if env else cache_dir() / "data"
