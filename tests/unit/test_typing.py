"""Type checkers see the decorated function's own signature (ParamSpec) and return type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_accepts_the_typing_checks_and_the_package() -> None:
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "tests/typing/check_types.py", "mplaunch"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr


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
