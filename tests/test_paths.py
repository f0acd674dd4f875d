"""glmserve's cache directory."""

from __future__ import annotations

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

