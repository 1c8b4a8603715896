"""Per-rank output: prefixes, console filtering, log files (in a script, to see the real console)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_scripts import REPO, run_script, write_script

CHATTY = """
    import sys
    from mplaunch import parallel
    sys.path.insert(0, sys.argv[1])
    from tests import workers

    if __name__ == "__main__":
        log_dir = sys.argv[2] if len(sys.argv) > 2 else None
        run = parallel(nprocs=2, start_method="fork", timeout=60, prefix_output=True,
                       console_ranks=[0] if log_dir else None, log_dir=log_dir)(workers.chatty)
        print("result", run(3))
"""


def test_prefix_marks_every_line_with_its_rank(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, CHATTY), str(REPO))
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    for rank in (0, 1):
        assert [line for line in out if line.startswith(f"[rank {rank}] out")] == [
            f"[rank {rank}] out {i} from {rank}" for i in range(3)
        ]
        assert f"[rank {rank}] no newline at the end" in out
        assert f"[rank {rank}] err from {rank}" in done.stderr.splitlines()
    assert "result 0" in out


def test_console_ranks_and_log_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    done = run_script(write_script(tmp_path, CHATTY), str(REPO), str(logs))
    assert done.returncode == 0, done.stderr
    assert "[rank 0] out 0 from 0" in done.stdout and "from 1" not in done.stdout + done.stderr
    rank1 = (logs / "rank1.log").read_text().splitlines()
    assert rank1[:3] == [f"[rank 1] out {i} from 1" for i in range(3)] and "[rank 1] err from 1" in rank1
    assert "[rank 0] out 0 from 0" in (logs / "rank0.log").read_text()
