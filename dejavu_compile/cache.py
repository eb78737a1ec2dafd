"""Where the package caches what it builds or converts (kernels, dequantized weights, plans)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$DEJAVU_CACHE` or `~/.cache/dejavu_compile`."""
    root = os.environ.get("DEJAVU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dejavu_compile")
    return Path(root)
