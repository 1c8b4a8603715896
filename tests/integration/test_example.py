"""The README's main job: the digits example trains to >= 0.9 accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_reaches_ninety_percent() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_digits.py")],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    match = re.search(r"accuracy on \d+ held-out digits: ([0-9.]+)", done.stdout)
    assert match is not None, done.stdout
    assert float(match.group(1)) >= 0.9
