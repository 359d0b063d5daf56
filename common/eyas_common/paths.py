"""Where eyas keeps its caches, whether it runs from a checkout or from an installed package (images)."""

from __future__ import annotations

import os
from pathlib import Path


def checkout_root() -> Path | None:
    """The repository checkout this package runs from (editable install, PYTHONPATH), or None when installed."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "common" / "eyas_common").is_dir() else None


def cache_root() -> Path:
    """$EYAS_CACHE; else the checkout's .cache; else (an installed package) $XDG_CACHE_HOME/eyas or ~/.cache/eyas."""
    if env := os.environ.get("EYAS_CACHE"):
        return Path(env)
    if (root := checkout_root()) is not None:
        return root / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eyas"
