"""Type checkers see the decorated function's own signature (ParamSpec) and return type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_strict_accepts_the_package_the_tests_and_the_typing_checks() -> None:
    """``mypy`` as configured in pyproject.toml (strict) checks every Python file of the package and of tests/,
    tests/typing/check_types.py among them (its ``type: ignore`` comments must each be needed)."""
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    files = [*REPO.glob("mplaunch/**/*.py"), *REPO.glob("tests/**/*.py")]
    assert REPO / "tests" / "typing" / "check_types.py" in files
    assert f"Success: no issues found in {len(files)} source files" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pyright_accepts_the_typing_checks() -> None:
    """Where pyright is installed (``pip install pyright``; it needs Node.js): the same file, checked by pyright."""
    pytest.importorskip("pyright")
    done = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, "tests/typing/check_types.py"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 errors" in done.stdout
