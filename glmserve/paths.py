"""Where glmserve keeps its files on this machine: one cache root, read from the environment at call time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """glmserve's cache root: `$GLMSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/glmserve`, else `~/.cache/glmserve`
    (learned indexers of the embedded model under `indexers/`, session KV under `sessions/`)."""
    if explicit := os.environ.get("GLMSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "glmserve"
    return Path.home() / ".cache" / "glmserve"
