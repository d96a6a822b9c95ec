"""Where cardfit keeps what it makes once and reuses: $CARDFIT_CACHE, else ~/.cache/cardfit."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CARDFIT_CACHE", Path.home() / ".cache" / "cardfit"))
