"""The package floors (pyproject.toml [tool.importlinter], from ../shared/DESIGN.md) hold: a change that makes a
lower package import a higher one, or server/ reach past the engine's API, fails the default run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache", str(config)], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent)})


def test_package_floors_hold() -> None:
    result = _lint(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_contract_catches_an_upward_import(tmp_path: Path) -> None:
    """The same contracts on a copy of the package with one upward import (kv/ importing the engine) break."""
    shutil.copytree(ROOT / "glmserve", tmp_path / "glmserve", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    offender = tmp_path / "glmserve" / "kv" / "upward.py"
    offender.write_text(textwrap.dedent('''
        """An import that breaks the floors."""
        from glmserve.engine.sequence import Sequence  # noqa: F401
    '''))
    result = _lint(ROOT / "pyproject.toml", tmp_path)
    assert result.returncode != 0
    assert "glmserve.kv.upward -> glmserve.engine.sequence" in result.stdout


def test_gateway_contract_catches_torch(tmp_path: Path) -> None:
    """gateway/ importing torch (even through a helper module of its own) breaks the HTTP-only contract."""
    shutil.copytree(ROOT / "glmserve", tmp_path / "glmserve", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "glmserve" / "gateway" / "tensor_helper.py").write_text('"""Offends."""\nimport torch  # noqa: F401\n')
    result = _lint(ROOT / "pyproject.toml", tmp_path)
    assert result.returncode != 0
    assert "glmserve.gateway.tensor_helper -> torch" in result.stdout


def test_the_gateway_command_runs_without_torch() -> None:
    """`glmserve gateway` (the CLI's parser, the gateway app and its workers' entry point) loads no torch,
    transformers or engine code: a gateway process starts in a fraction of a second and stays small."""
    code = ("import sys, glmserve.cli, glmserve.gateway.app, glmserve.gateway.workers; "
            "glmserve.cli.build_parser().parse_args(['gateway', '--backend', 'http://127.0.0.1:9']); "
            "print(sorted(m for m in ('torch', 'transformers', 'glmserve.engine') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
