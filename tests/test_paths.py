"""glmserve's cache directory, and the test session's isolation from the machine's home directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glmserve.paths import cache_dir


def test_cache_dir_follows_the_environment_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("GLMSERVE_CACHE_DIR", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "glmserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "glmserve"
    monkeypatch.setenv("GLMSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_the_suite_runs_in_its_own_home_and_cache(isolated_root: Path) -> None:
    assert Path.home().is_relative_to(isolated_root) and cache_dir().is_relative_to(isolated_root)
    assert Path(os.environ["XDG_CACHE_HOME"]).is_relative_to(isolated_root)
    assert not Path(os.environ["TORCH_EXTENSIONS_DIR"]).is_relative_to(isolated_root)  # kernels built once
