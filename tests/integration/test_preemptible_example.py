"""examples/preemptible.py: a run stopped by SIGTERM saves a checkpoint and exits 143; the next run resumes
from it and ends with the same weights as a run that was never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "preemptible.py"
STEPS = 30


def _command(directory: Path, pause: float) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--dir", str(directory), "--steps", str(STEPS), "--pause", str(pause)]


def _run(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(_command(directory, 0.0), capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    done = _run(whole)
    assert done.returncode == 0, done.stderr
    assert f"step {STEPS - 1} " in done.stdout
    assert "resumed" not in done.stdout

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(_command(parts, 0.2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout is not None
        seen = []
        for line in first.stdout:  # wait for a step's line: training is under way
            seen.append(line)
            if line.startswith("step 3 "):
                break
        else:
            raise AssertionError(f"no 'step 3' line: {seen}, {first.communicate(timeout=60)}")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 128 + signal.SIGTERM, err
    assert "preempted by SIGTERM; run again to resume" in out, (out, err)
    saved = torch.load(parts / "ckpt.pt")
    assert 4 <= saved["step"] < STEPS
    assert not (parts / "final.pt").exists()

    resumed = _run(parts)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {saved['step']}" in resumed.stdout
    assert f"step {saved['step'] - 1} " not in resumed.stdout  # no step ran twice
    expected, got = torch.load(whole / "final.pt"), torch.load(parts / "final.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
