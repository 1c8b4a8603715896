"""Per-rank output: prefixes, console filtering, log files, in scripts whose stdout and stderr are pipes (a
terminal-like run: the real file descriptors, not pytest's capture)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mplaunch import parallel
from tests.helpers import REPO, run_script, write_script

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
    assert "[rank 0] out 0 from 0" in done.stdout
    assert "from 1" not in done.stdout + done.stderr
    rank1 = (logs / "rank1.log").read_text().splitlines()
    assert rank1[:3] == [f"[rank 1] out {i} from 1" for i in range(3)]
    assert "[rank 1] err from 1" in rank1
    assert "[rank 0] out 0 from 0" in (logs / "rank0.log").read_text()


# The example (a logging handler made at the top of the script, before the launch) and every other
# way a rank writes to its fd 1 and fd 2; each launch is announced on both streams, to split the output.
SOURCES = """
    import faulthandler, logging, os, subprocess, sys, warnings
    from mplaunch import parallel, worker_info

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    def dump_0(): faulthandler.dump_traceback(all_threads=False)  # lines 7, 8: in the faulthandler traceback
    def dump_1(): faulthandler.dump_traceback(all_threads=False)

    def work():
        rank = worker_info().rank
        print(f"print {rank}")
        logging.info("rank %d", rank)
        os.write(1, f"os.write {rank}\\n".encode())
        subprocess.run(["echo", f"echo {rank}"], check=True)
        subprocess.run(["sh", "-c", f"echo sh-stderr {rank} >&2"], check=True)
        warnings.warn(f"warning {rank}")
        (dump_0 if rank == 0 else dump_1)()
        return rank

    OPTIONS = {
        "prefix": dict(prefix_output=True),
        "console": dict(console_ranks=[0]),
        "logs": dict(log_dir="logs-logs"),
        "all": dict(prefix_output=True, console_ranks=[0], log_dir="logs-all"),
    }

    if __name__ == "__main__":
        for method, name in (arg.split(":") for arg in sys.argv[1:]):
            print(f"=== {method} {name}", flush=True)
            print(f"=== {method} {name}", file=sys.stderr, flush=True)
            parallel(nprocs=2, start_method=method, timeout=60, **OPTIONS[name])(work)()
"""

# what each rank writes to fd 1, and to fd 2
_OUT = ("print {r}", "os.write {r}", "echo {r}")
_ERR = ("INFO rank {r}", "sh-stderr {r}", "UserWarning: warning {r}", 'File "{script}", line {line} in dump_{r}')


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("=== "):
            current = sections.setdefault(line[4:], [])
        else:
            current.append(line)
    return sections


def _expect(lines: list[str], template: str, rank: int, prefix: bool, script: Path, present: bool = True) -> None:
    text = template.format(r=rank, script=script, line=7 + rank)
    label = f"[rank {rank}] " if prefix else ""
    found = [line for line in lines if text in line]
    if not present:
        assert not found, (text, lines)
        return
    assert len(found) == 1, (text, lines)  # whole, once
    assert found[0].startswith(label), (text, found)
    assert prefix or not found[0].startswith("[rank"), (text, found)


def _check_launch(out: list[str], err: list[str], name: str, prefix: bool, console: bool, path: Path) -> None:
    for rank in (0, 1):
        shown = not console or rank == 0
        for template in _OUT:
            _expect(out, template, rank, prefix, path, shown)
            _expect(err, template, rank, prefix, path, present=False)  # stdout stays stdout
        for template in _ERR:
            _expect(err, template, rank, prefix, path, shown)
            _expect(out, template, rank, prefix, path, present=False)


@pytest.mark.parametrize(
    "launches",
    [
        ["fork:prefix", "fork:console", "fork:logs", "fork:all"],
        pytest.param(["spawn:all", "forkserver:all"], marks=pytest.mark.slow),
    ],
)
def test_everything_a_rank_writes_is_routed(tmp_path: Path, launches: list[str]) -> None:
    script = write_script(tmp_path, SOURCES)
    done = run_script(script, *launches)
    assert done.returncode == 0, done.stderr
    outs, errs = _sections(done.stdout), _sections(done.stderr)
    for launch in launches:
        method, name = launch.split(":")
        prefix, console, logs = name in ("prefix", "all"), name in ("console", "all"), name in ("logs", "all")
        _check_launch(outs[f"{method} {name}"], errs[f"{method} {name}"], name, prefix, console, script)
        if logs:
            for rank in (0, 1):
                lines = (tmp_path / f"logs-{name}" / f"rank{rank}.log").read_text().splitlines()
                for template in _OUT + _ERR:
                    _expect(lines, template, rank, prefix, script)


LOST = """
    import ctypes, faulthandler, os, signal, sys, time
    from mplaunch import parallel, worker_info

    def work(how):
        rank = worker_info().rank
        print(f"line of {rank}")
        sys.stdout.write(f"partial of {rank}")
        sys.stdout.flush()
        os.write(2, f"error text of {rank}\\n".encode())
        if rank == 0:
            open(f"written-{how}", "w").close()
        if rank == 1:
            deadline = time.monotonic() + 30
            while not os.path.exists(f"written-{how}") and time.monotonic() < deadline:
                time.sleep(0.01)  # fail only once rank 0 has written: then its text must not be lost
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise ValueError("on purpose")
            if how == "exit":
                os._exit(3)
            if how == "segfault":  # faulthandler writes the crash's traceback to fd 2
                faulthandler.enable()
                ctypes.string_at(0)
        time.sleep(60)  # stopped by the other rank's failure, or by the timeout

    if __name__ == "__main__":
        for how in sys.argv[1:]:
            try:
                parallel(nprocs=2, start_method="fork", timeout=2 if how == "timeout" else 60, grace_period=1,
                         console_ranks=[1], log_dir=f"logs-{how}")(work)(how)
            except Exception as error:
                print(f"=== {how} raised {type(error).__name__}", flush=True)
                print(f"=== {how}", file=sys.stderr, flush=True)
"""


def test_nothing_a_rank_wrote_is_lost_when_it_fails_or_is_stopped(tmp_path: Path) -> None:
    hows = ["kill", "raise", "exit", "timeout", "segfault"]
    done = run_script(write_script(tmp_path, LOST), *hows)
    assert done.returncode == 0, done.stderr
    # the rank's text is on the console before the call raised: it comes before the line printed after
    out, err = done.stdout.split("=== "), done.stderr.split("=== ")
    raised = ["WorkerExitedError", "ValueError", "WorkerExitedError", "LaunchTimeoutError", "WorkerExitedError"]
    for index, (how, kind) in enumerate(zip(hows, raised, strict=True)):
        assert out[index + 1].startswith(f"{how} raised {kind}"), done.stdout
        assert out[index].rstrip().endswith("line of 1\npartial of 1"), (how, done.stdout)
        assert "error text of 1" in err[index], (how, done.stderr)
        assert "of 0" not in out[index] + err[index]
        for rank in (0, 1):
            log = (tmp_path / f"logs-{how}" / f"rank{rank}.log").read_text().splitlines()
            fatal = "Fatal Python error: Segmentation fault"
            if how == "segfault" and rank == 1:  # the crash's traceback, after what the rank wrote
                log, crash = log[: log.index(fatal)], log[log.index(fatal) :]
                lines = [line.strip() for line in textwrap.dedent(LOST).splitlines()]
                crash_line = 1 + lines.index("ctypes.string_at(0)")
                assert any(line.endswith(f", line {crash_line} in work") for line in crash), crash
                assert fatal in err[index]
            assert sorted(log) == sorted([f"line of {rank}", f"partial of {rank}", f"error text of {rank}"]), how


PROGRESS = """
    import os, sys, time
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method="fork", timeout=60, prefix_output=True)
    def progress(go_on):
        if worker_info().rank == 0:
            for step in (1, 2):
                sys.stdout.write(f"\\rstep {step}/2")
                sys.stdout.flush()
                while step == 1 and not os.path.exists(go_on):  # the test reads the first bar, then says go on
                    time.sleep(0.02)
            sys.stdout.write("\\n")
        return 0

    if __name__ == "__main__":
        progress(sys.argv[1])
        print("done")
"""


def test_a_progress_bar_arrives_before_its_line_ends(tmp_path: Path) -> None:
    go_on = tmp_path / "go-on"
    script = write_script(tmp_path, PROGRESS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, str(script), str(go_on)], stdout=subprocess.PIPE, env=env) as process:
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        seen, deadline = b"", time.monotonic() + 60
        while b"step 1/2" not in seen and time.monotonic() < deadline and process.poll() is None:
            seen += process.stdout.read() or b""
            time.sleep(0.02)
        go_on.touch()
        os.set_blocking(process.stdout.fileno(), True)
        seen += process.stdout.read()
        assert process.wait(60) == 0
    assert seen == b"\r[rank 0] step 1/2\r[rank 0] step 2/2\ndone\n"


FOLLOWS = """
    import os, sys
    from mplaunch import parallel

    def hello(word):
        print(word, flush=True)
        os.write(2, word.encode() + b" on stderr\\n")

    if __name__ == "__main__":
        run = parallel(nprocs=1, start_method="forkserver", timeout=60)(hello)
        run("first")  # starts the fork server with this process's fd 1 and 2
        with open("redirected.txt", "w") as file:
            os.dup2(file.fileno(), 1)
            os.dup2(file.fileno(), 2)
        run("second")
"""


def test_forkserver_workers_write_to_the_callers_current_descriptors(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, FOLLOWS))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "first\n"
    assert done.stderr == "first on stderr\n"
    assert sorted((tmp_path / "redirected.txt").read_text().splitlines()) == ["second", "second on stderr"]


def _echo_everywhere() -> None:
    print("print line")
    os.write(1, b"os.write line\n")
    subprocess.run(["echo", "echo line"], check=True)


def test_workers_write_to_the_callers_sys_stdout_object() -> None:
    """Like a Jupyter kernel, whose sys.stdout is no descriptor: the workers' fd 1 reaches that object."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        parallel(nprocs=2, start_method="fork", timeout=60)(_echo_everywhere)()
    lines = buffer.getvalue().splitlines()
    assert sorted(lines) == sorted(["print line", "os.write line", "echo line"] * 2)


STANDARD_FDS_CLOSED = """
    import sys
    import mplaunch
    from mplaunch import parallel, worker_info

    def say() -> int:
        print(f"out {worker_info().rank}", flush=True)
        print(f"err {worker_info().rank}", file=sys.stderr, flush=True)
        return worker_info().rank + 10

    def count():
        yield from range(3)

    if __name__ == "__main__":
        start_method, log_dir, result = sys.argv[1:]
        options = dict(nprocs=2, start_method=start_method, timeout=90)
        steps = {
            "log_dir": lambda: parallel(log_dir=log_dir, **options)(say)(),
            "stream": lambda: list(parallel(**options)(count)()),
            "warm": lambda: mplaunch.Workers(**options).run(say),
        }
        found = {}
        for name, step in steps.items():  # fds 1 and 2 may be closed: what failed goes to the file
            try:
                found[name] = step()
            except BaseException as error:
                found[name] = repr(error)
        with open(result, "w") as file:
            file.write(repr(found))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("start_method", "closed"), [("spawn", (1, 2)), ("fork", (0, 1, 2)), ("forkserver", (0, 1, 2))]
)
def test_a_program_started_with_its_standard_descriptors_closed_launches(
    tmp_path: Path, start_method: str, closed: tuple[int, ...]
) -> None:
    """A daemon or a GUI host starts Python with fds 0-2 closed. A memory file of the launch took fd 1 or 2, and a
    spawned rank's stdout replaced it: "the memory file holds no complete object", empty log files. Every
    descriptor a launch hands down is here: the payload, outcome files and output pipes (``log_dir``), a
    generator's pipes, warm ranks' pipes."""
    script, result, logs = write_script(tmp_path, STANDARD_FDS_CLOSED), tmp_path / "result", tmp_path / "logs"
    closing = " ".join(f"{fd}>&-" for fd in closed)
    command = [
        "sh",
        "-c",
        f'exec "$0" "$@" {closing}',
        sys.executable,
        str(script),
        start_method,
        str(logs),
        str(result),
    ]
    subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=240, check=True)
    assert result.read_text() == repr({"log_dir": 10, "stream": [0, 1, 2], "warm": 10})
    for rank in (0, 1):
        assert sorted((logs / f"rank{rank}.log").read_text().splitlines()) == [f"err {rank}", f"out {rank}"]


def test_launches_at_the_same_time_cannot_share_a_log_dir(tmp_path: Path) -> None:
    """Issue 37: two submit() launches with one log_dir overwrote and interleaved each other's rank{N}.log (and
    would their stacks files and NCCL traces). A launch or Workers now holds its log_dir while it runs, and
    another that names it is refused with the fix; a child the caller forked meanwhile does not keep it held."""
    from mplaunch import LaunchRefusedError, Workers
    from tests import warm_workers

    logs, started, release = str(tmp_path / "logs"), str(tmp_path / "started"), str(tmp_path / "release")
    waiting = parallel(nprocs=1, start_method="fork", timeout=60, log_dir=logs)(warm_workers.wait_for)
    first = waiting.submit(release, started)
    while not os.path.exists(started):
        time.sleep(0.01)
    child = os.fork()
    if child == 0:  # pragma: no cover - a child of the caller (a DataLoader worker, say) that outlives the launch
        time.sleep(30)
        os._exit(0)
    try:
        with pytest.raises(LaunchRefusedError, match=r"log_dir=.* is used by another launch that still runs"):
            parallel(nprocs=1, start_method="fork", timeout=60, log_dir=logs)(print)("second")
        with pytest.raises(LaunchRefusedError, match="its own log_dir"):
            Workers(nprocs=1, start_method="fork", timeout=60, log_dir=logs)
        open(release, "w").close()
        assert first.result(60) == "seen"
        parallel(nprocs=1, start_method="fork", timeout=60, log_dir=logs)(print)("third")
        assert (tmp_path / "logs" / "rank0.log").read_text() == "third\n"
    finally:
        open(release, "w").close()
        first.result(60)
        os.kill(child, 9)
        os.waitpid(child, 0)
