"""``post_mortem=True`` (issue 24): pdb at the failing line of the first rank that raises, on the caller's
terminal, driven here through a pseudo-terminal; without a terminal, a warning points to ``fn.debug()``."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from mplaunch import Workers, parallel
from tests import warm_workers

pexpect = pytest.importorskip("pexpect")

SCRIPT = """
import sys
from mplaunch import Workers, parallel, worker_info


def fail(x):
    secret = x * 7
    if worker_info().rank == 1:
        raise ValueError(f"rank 1 fails with {secret}")
    return secret


if __name__ == "__main__":
    if sys.argv[2] == "launch":
        run = parallel(nprocs=2, start_method=sys.argv[1], timeout=120, post_mortem=True)(fail)
    else:
        workers = Workers(nprocs=2, start_method=sys.argv[1], timeout=120, post_mortem=True)
        run = lambda x: workers.run(fail, x)
    for attempt in range(2 if sys.argv[2] == "warm" else 1):
        try:
            run(6)
        except ValueError as error:
            print("RAISED", error, "in rank", error.rank, flush=True)
"""


@pytest.mark.parametrize(("start_method", "how"), [("fork", "launch"), ("spawn", "launch"), ("fork", "warm")])
def test_post_mortem_stops_at_the_raising_line_of_the_failing_rank(start_method: str, how: str, tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    child = pexpect.spawn(
        sys.executable, [str(script), start_method, how], env=env, timeout=90, encoding="utf-8", cwd=str(tmp_path)
    )
    try:
        for _ in range(2 if how == "warm" else 1):  # warm ranks: a later call's failure debugs again
            child.expect_exact("(Pdb rank 1) ")
            assert 'raise ValueError(f"rank 1 fails with {secret}")' in child.before
            child.sendline("p secret")
            child.expect_exact("42")
            child.expect_exact("(Pdb rank 1) ")
            child.sendline("p worker_info().rank")
            child.expect_exact("1")
            child.expect_exact("(Pdb rank 1) ")
            child.sendline("q")
            child.expect_exact("RAISED rank 1 fails with 42 in rank 1")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_without_a_terminal_post_mortem_warns_and_points_to_debug() -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=90, post_mortem=True)(warm_workers.raise_in_rank)
    with pytest.warns(RuntimeWarning, match=r"fn\.debug"), pytest.raises(ValueError, match="rank 1 fails"):
        run(1)
    with pytest.warns(RuntimeWarning, match=r"fn\.debug"), Workers(nprocs=1, start_method="fork", post_mortem=True):
        pass
