"""Issue 22 without processes: reading faulthandler dumps, the heartbeat board, the OOM count, the messages."""

from __future__ import annotations

import os
import pickle
import signal
import sysconfig
import time
from pathlib import Path

import pytest
import torch

import mplaunch
from mplaunch import InvalidOptionError, LaunchTimeoutError, ParallelConfig, RunReport, StallError
from mplaunch._parent import stacks
from mplaunch._parent.outcomes import exit_error
from mplaunch._platform.oom import oom_counters, oom_kills
from mplaunch._wire.board import BEAT, MAX_RSS, STACKS_SIGNAL, Board
from mplaunch._worker import heartbeat

PACKAGE = os.path.dirname(mplaunch.__file__)
TORCH = os.path.dirname(torch.__file__)
STDLIB = sysconfig.get_paths()["stdlib"]
ENTRY = os.path.join(PACKAGE, "_worker", "entry.py")


def _dump(*threads: list[tuple[str, int, str]], current: int = 0) -> str:
    parts = []
    for index, frames in enumerate(threads):
        head = "Current thread" if index == current else "Thread"
        lines = [f"{head} 0x00007f{index:010x} (most recent call first):"]
        lines += [f'  File "{file}", line {line} in {function}' for file, line, function in frames]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


MAIN = [
    (f"{TORCH}/distributed/distributed_c10d.py", 5356, "barrier"),
    (f"{STDLIB}/contextlib.py", 81, "inner"),
    ("/home/me/project/train.py", 30, "step"),
    ("/home/me/project/train.py", 50, "train"),
    (ENTRY, 159, "execute"),
    (ENTRY, 284, "run"),
    ("/home/me/project/launch.py", 10, "<module>"),  # the parent's frames, inherited through fork
]
WATCHER = [(ENTRY, 79, "watch"), (f"{STDLIB}/threading.py", 982, "run")]


def test_threads_parses_every_frame() -> None:
    found = stacks.threads(_dump(WATCHER, MAIN, current=1))
    assert [len(t) for t in found] == [2, 7]
    assert found[1][0] == stacks.Frame(f"{TORCH}/distributed/distributed_c10d.py", 5356, "barrier")


def test_a_forked_workers_dump_leaves_out_the_parents_frames() -> None:
    """A forked rank's stack went on below its function into the parent's launch and the caller's script
    (`_api.py ... __call__`, `launch.py line 10 <module>`), frames it inherited and never ran."""
    forking = os.path.join(PACKAGE, "_parent", "processes.py")
    inherited = [
        (f"{STDLIB}/multiprocessing/process.py", 314, "_bootstrap"),
        (forking, 153, "_fork_all"),
        (forking, 110, "start_workers"),
        (os.path.join(PACKAGE, "_api.py"), 98, "__call__"),
        ("/home/me/project/launch.py", 10, "<module>"),
    ]
    main = [*MAIN[:-1], *inherited]
    text = stacks.above_the_fork(_dump(WATCHER, main, current=1))
    found = stacks.threads(text)
    assert found == stacks.threads(_dump(WATCHER, [*MAIN[:-1], inherited[0]], current=1))
    assert "<module>" not in text and "__call__" not in text and text.count("Thread 0x") == 1
    assert stacks.above_the_fork(_dump(WATCHER)) == _dump(WATCHER)  # a spawned worker's: nothing inherited


def test_the_user_frame_of_the_thread_that_runs_the_function() -> None:
    frame = stacks.innermost_user_frame(_dump(WATCHER, MAIN))
    assert frame is not None
    assert (frame.function, frame.line) == ("step", 30)


def test_library_frames_count_when_the_user_has_none_above_the_entry() -> None:
    library = [
        (f"{TORCH}/distributed/distributed_c10d.py", 1, "barrier"),
        ("/venv/lib/python3.11/site-packages/lightning/trainer.py", 7, "fit"),
        (ENTRY, 159, "execute"),
        ("/home/me/project/launch.py", 10, "<module>"),
    ]
    frame = stacks.innermost_user_frame(_dump(library))
    assert frame is not None
    assert frame.function == "fit"
    only_ours = [(f"{TORCH}/x.py", 1, "init_process_group"), (ENTRY, 159, "execute"), ("/p/launch.py", 1, "<module>")]
    frame = stacks.innermost_user_frame(_dump(only_ours))
    assert frame is not None
    assert frame.function == "init_process_group"  # never the parent's inherited frames


def test_dumps_without_frames_and_single_stack_format() -> None:
    assert stacks.innermost_user_frame("") is None
    assert stacks.innermost_user_frame("Current thread 0x1 (most recent call first):\n  <no Python frame>\n") is None
    single = 'Stack (most recent call first):\n  File "/u/a.py", line ??? in f\n'
    frame = stacks.innermost_user_frame(single)
    assert frame is not None
    assert frame.line is None
    assert str(frame).startswith("f (")


def test_summary_names_each_rank() -> None:
    text = stacks.summary({1: _dump(MAIN), 0: ""})
    assert text.startswith("rank 0: no Python frame; rank 1 in step (/home/me/project/train.py:30)")


def test_summary_says_when_no_frame_of_the_users_code_is_on_the_stack() -> None:
    """A rank stuck after its function returned (a destructor joining threads) showed mplaunch's own frame as
    if it were the user's: ``rank 1 in __call__ (mplaunch/_spawn_compat.py:26)``."""
    wrapper = (f"{PACKAGE}/_spawn_compat.py", 26, "__call__")
    text = stacks.summary({1: _dump([wrapper, (ENTRY, 177, "execute"), ("/p/launch.py", 1, "<module>")])})
    assert text == f"rank 1 outside your code, in {stacks.Frame(*wrapper)}"


@pytest.mark.parametrize("file", ["<stdin>", "<string>", "<ipython-input-3-0123abcd>", "<python-input-0>"])
def test_code_typed_at_a_prompt_or_run_with_exec_is_the_users(file: str) -> None:
    """A function defined at the Python or IPython prompt, in ``python -c`` or with ``exec`` (forked ranks
    run it) has no file: it was named ``outside your code``, and a library frame it called won over it."""
    user = (file, 3, "waiting")
    dump = _dump([(f"{STDLIB}/threading.py", 320, "wait"), user, (ENTRY, 177, "execute")])
    assert stacks.summary({0: dump}) == f"rank 0 in {stacks.Frame(*user)}"
    frozen = ("<frozen importlib._bootstrap>", 241, "_call_with_frames_removed")
    assert stacks.summary({0: _dump([frozen, (ENTRY, 177, "execute")])}).startswith("rank 0 outside your code")


def test_a_function_without_python_frames_is_never_placed_in_the_parents_frames() -> None:
    """A rank running a C function (``parallel()(time.sleep)``) has the entry as its innermost frame; below it
    are the parent's frames that a forked worker inherited, and the launch named the parent's line that made
    the call as where the rank was."""
    dump = _dump([(ENTRY, 177, "execute"), (ENTRY, 394, "run"), ("/home/me/project/launch.py", 10, "<module>")])
    assert stacks.summary({0: dump}) == f"rank 0 outside your code, in {stacks.Frame(ENTRY, 177, 'execute')}"


def test_collect_skips_ranks_that_cannot_dump(tmp_path: Path) -> None:
    def gone() -> None:
        raise ProcessLookupError

    (tmp_path / "rank1.stacks").write_text("")
    start = time.monotonic()
    assert stacks.collect(str(tmp_path), {0: gone, 1: gone}) == {}  # rank 0 has no file: never signalled
    assert time.monotonic() - start < 0.5


def test_collect_reads_a_dump_written_on_the_signal(tmp_path: Path) -> None:
    path = tmp_path / "rank0.stacks"
    path.write_text("an old dump")

    def send() -> None:
        with open(path, "a") as file:  # what the worker's faulthandler does: append to the truncated file
            file.write(_dump(MAIN))

    assert stacks.collect(str(tmp_path), {0: send}) == {0: _dump(MAIN)}


def test_board_slots_and_heartbeat(tmp_path: Path) -> None:
    parent = Board(str(tmp_path), 2, create=True)
    worker = Board(str(tmp_path), 2, create=False)
    try:
        assert parent.get(1, BEAT) == 0.0
        mplaunch.heartbeat()  # outside a launch: nothing
        assert parent.get(0, BEAT) == parent.get(1, BEAT) == 0.0
        heartbeat._slots, heartbeat._index = worker.slots, 1 * 4 + BEAT
        try:
            before = time.monotonic()
            mplaunch.heartbeat()
            assert before <= parent.get(1, BEAT) <= time.monotonic()
            assert parent.get(0, BEAT) == 0.0
        finally:
            heartbeat._slots = None
        worker.set(0, MAX_RSS, 1024.0)
        assert parent.get(0, MAX_RSS) == 1024.0
        parent.clear()
        assert parent.get(1, BEAT) == 0.0
        assert parent.get(0, MAX_RSS) == 0.0
    finally:
        worker.close()
        parent.close()


def test_the_dump_signal_is_not_the_users() -> None:
    assert STACKS_SIGNAL is not None
    assert STACKS_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2)
    assert signal.SIGRTMIN < STACKS_SIGNAL <= signal.SIGRTMAX


V1_MOUNTS = "33 25 0:30 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
V2_MOUNTS = "35 30 0:31 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


def test_oom_count_v2(tmp_path: Path) -> None:
    events = "sys/fs/cgroup/job/memory.events"
    root = _tree(tmp_path, "0::/job\n", V2_MOUNTS, {events: "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n"})
    counters = oom_counters(42, root)
    assert counters == (os.path.join(root, events),)
    assert oom_kills(counters) == 2


def test_oom_count_v1(tmp_path: Path) -> None:
    control = "sys/fs/cgroup/memory/docker/abc/memory.oom_control"
    root = _tree(
        tmp_path,
        "4:memory:/docker/abc\n0::/\n",
        V1_MOUNTS + V2_MOUNTS,
        {control: "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"},
    )
    assert oom_kills(oom_counters(42, root)) == 5


def test_oom_count_unknown_in_the_root_cgroup_or_without_files(tmp_path: Path) -> None:
    root = _tree(tmp_path, "0::/\n", V2_MOUNTS, {"sys/fs/cgroup/memory.events": "oom_kill 0\n"})
    assert oom_counters(42, root) == ()
    assert oom_kills(()) is None
    assert oom_counters(43, root) == ()  # no such process


@pytest.mark.parametrize(
    ("kills", "oom", "text"),
    [
        (1, True, "rank 1 (pid 9) was killed by the out-of-memory killer"),
        (0, False, "Not the out-of-memory killer"),
        (None, None, "the out-of-memory killer is a possible cause"),
    ],
)
def test_sigkill_names_the_oom_killer_only_when_the_kernel_counted_it(
    kills: int | None, oom: bool | None, text: str
) -> None:
    error = exit_error(1, 9, -signal.SIGKILL, None, kills)
    assert error.oom is oom
    assert text in str(error)
    assert ("killed by the out-of-memory killer" in str(error)) is (oom is True)
    assert pickle.loads(pickle.dumps(error)).oom is oom


def test_other_ends_are_never_the_oom_killer() -> None:
    assert exit_error(1, 9, -signal.SIGSEGV, None, 3).oom is False
    assert exit_error(1, 9, 2, None, 3).oom is False


def test_errors_with_stacks_pickle() -> None:
    stall = StallError("rank 1 stalled", 1, 9, 2.5, 1.0, {0: "a", 1: "b"})
    stall.report = RunReport((), 1.5)
    copy = pickle.loads(pickle.dumps(stall))
    assert (copy.rank, copy.silent, copy.stall_timeout, copy.stacks) == (1, 2.5, 1.0, {0: "a", 1: "b"})
    assert copy.report == RunReport((), 1.5)
    timeout = pickle.loads(pickle.dumps(LaunchTimeoutError("late", 4.0, (0, 1), {0: "x"})))
    assert timeout.stacks == {0: "x"}
    assert timeout.running == (0, 1)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "5", True])
def test_stall_timeout_is_validated(value: object) -> None:
    with pytest.raises(InvalidOptionError, match="stall_timeout="):
        ParallelConfig(stall_timeout=value)  # type: ignore[arg-type]
    assert ParallelConfig(stall_timeout=2).stall_timeout == 2.0


@pytest.mark.parametrize(("backend", "log_dir"), [("nccl", "/logs"), ("gloo", "/logs"), ("nccl", None)])
def test_nccl_flight_recorder_points_at_log_dir(
    monkeypatch: pytest.MonkeyPatch, backend: str, log_dir: str | None
) -> None:
    from mplaunch._wire.spec import LaunchSpec, WorkerSpec

    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}  # the user's own value stays
    monkeypatch.setattr(os, "environ", environ)
    spec = WorkerSpec(LaunchSpec("/d", 1, "fork", 1, 1, frozenset({0}), backend=backend, log_dir=log_dir))
    heartbeat._flight_recorder(spec)
    if backend == "nccl" and log_dir is not None:
        assert environ == {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/logs/nccl_trace_rank_",
        }
    else:
        assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
