"""Every option in every way of calling (issue 36): each cell of the options reference's table either has its
effect, or is refused before any rank starts with a message that names the way of calling.

The table is read from the options' metadata (``ParallelConfig``'s fields), the same source the docs render.
Each option has a probe: a value, the function the ranks run, and a check of what comes back. A cell runs the
probe in its way of calling; the multi-node column runs its probes on two nodes of this machine, in one job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mplaunch import (
    InvalidOptionError,
    LaunchTimeoutError,
    PreemptedError,
    StallError,
    Workers,
    parallel,
)
from mplaunch._config import MODES, PER_CALL, ParallelConfig, refused_in
from tests import workers
from tests.helpers import REPO, free_port, write_script

TIMEOUT = 60.0
#: What every cell runs with, but for its own option (multi-node: one rank per node).
BASE: dict[str, Any] = {"nprocs": 2, "start_method": "fork", "timeout": TIMEOUT}
NODE_BASE: dict[str, Any] = {
    "nprocs": 1,
    "start_method": "fork",
    "timeout": TIMEOUT,
    "nnodes": 2,
    "rdzv_endpoint": "127.0.0.1:1",  # (replaced by a free port where the call runs: a refusal comes first)
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a cell's call gave: its value or the exception it raised, how long it took, what it warned and
    printed (the ranks' output, routed to this process's ``sys.stdout``)."""

    value: Any
    seconds: float
    warned: tuple[str, ...]
    out: str
    directory: Path


@dataclasses.dataclass(frozen=True)
class Probe:
    """How to see one option's effect: its ``value`` (per mode in ``values``), other options it needs
    (``extra``, per mode in ``extras``), the function the ranks run and its arguments, ``during`` (run in a
    thread while the call runs, given a function that preempts it), and ``check`` of the outcome."""

    value: Any
    check: Callable[[Outcome, str], None]
    function: Callable[..., Any] = workers.seen
    args: Callable[[Path], tuple[Any, ...]] = lambda directory: (str(directory),)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    during: Callable[[Path, int, Callable[[], None]], None] | None = None

    def options(self, name: str, mode: str, refused: bool = False) -> dict[str, Any]:
        """The options of ``name``'s cell in ``mode``; a refused cell's: the base and this option alone."""
        base = NODE_BASE if mode == "multi-node" else BASE
        extra = {} if refused else {**self.extra, **self.extras.get(mode, {})}
        return {**base, **extra, name: self.values.get(mode, self.value)}


def _seen(outcome: Outcome) -> dict[str, Any]:
    assert isinstance(outcome.value, dict), outcome.value
    return outcome.value


def _raised(kind: type[BaseException], text: str = "") -> Callable[[Outcome, str], None]:
    def check(outcome: Outcome, mode: str) -> None:
        assert isinstance(outcome.value, kind), outcome.value
        assert text in str(outcome.value), outcome.value

    return check


def _ready_then_preempt(directory: Path, ranks: int, preempt: Callable[[], None]) -> None:
    """Preempt the call once ``ranks`` ranks run (wrote their ``ready-N``)."""
    deadline = time.monotonic() + TIMEOUT
    while len(list(directory.glob("ready-*"))) < ranks:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    preempt()


def _check_world(size: int, nodes: int) -> Callable[[Outcome, str], None]:
    """The world has ``size`` ranks (``nodes`` on two nodes)."""

    def check(outcome: Outcome, mode: str) -> None:
        assert _seen(outcome)["world_size"] == (nodes if mode == "multi-node" else size)

    return check


def _check_spawned(outcome: Outcome, mode: str) -> None:
    assert _seen(outcome)["inherited"] is None  # a forked rank would have the parent's value


def _check_all(outcome: Outcome, mode: str) -> None:
    assert isinstance(outcome.value, list), outcome.value
    assert [value["rank"] for value in outcome.value] == list(range(len(outcome.value)))
    assert len(outcome.value) == (1 if mode == "multi-node" else 2)  # multi-node: this node's ranks


def _check_timeout(outcome: Outcome, mode: str) -> None:
    _raised(LaunchTimeoutError, "timeout=1")(outcome, mode)
    if mode != "multi-node":  # each node stops its own ranks there, without stacks
        assert "stuck_here" in str(outcome.value), outcome.value


def _check_grace(outcome: Outcome, mode: str) -> None:
    assert isinstance(outcome.value, (LaunchTimeoutError, PreemptedError)), outcome.value
    assert outcome.seconds < 8.0, outcome.seconds  # the default grace period alone is 5 s (twice for a warm call)


def _check_prefix(outcome: Outcome, mode: str) -> None:
    assert "[rank 0] probe line of rank 0" in outcome.out, outcome.out


def _check_console(outcome: Outcome, mode: str) -> None:
    assert "probe line of rank 0" in outcome.out, outcome.out
    assert "probe line of rank 1" not in outcome.out, outcome.out


def _check_log(outcome: Outcome, mode: str) -> None:
    assert "probe line of rank 0" in (outcome.directory / "logs" / "rank0.log").read_text()


def _check_restarted(outcome: Outcome, mode: str) -> None:
    assert _seen(outcome)["restart_count"] == 1
    assert any("attempt 1 of 2 failed" in text for text in outcome.warned) or mode == "multi-node"


def _check_not_restarted(outcome: Outcome, mode: str) -> None:
    assert isinstance(outcome.value, KeyError), outcome.value
    assert outcome.value.earlier_attempts == ()  # type: ignore[attr-defined]


def _check_delay(outcome: Outcome, mode: str) -> None:
    _check_restarted(outcome, mode)
    # A rank may be stopped before it notes its first start (its peer failed first): compare across ranks.
    lines = [line.split() for path in outcome.directory.glob("starts-*") for line in path.read_text().splitlines()]
    failed = max(float(stamp) for stamp, attempt in lines if attempt == "0")
    again = min(float(stamp) for stamp, attempt in lines if attempt == "1")
    assert again - failed >= 0.5, lines


def _check_devices(outcome: Outcome, mode: str) -> None:
    assert _seen(outcome)["cuda"] in ("0", "1")  # one of the two devices this process sees (pretended)


def _check_bound(outcome: Outcome, mode: str) -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to split between ranks")
    assert set(_seen(outcome)["cpus"]) < allowed  # its own share of this process's CPUs


def _check_post_mortem(outcome: Outcome, mode: str) -> None:
    _seen(outcome)
    assert any("post_mortem=True needs a terminal" in text for text in outcome.warned) or mode == "multi-node"


def _check_accepted(outcome: Outcome, mode: str) -> None:
    """Options of a rendezvous of several nodes, on one node: the call runs (multi-node: across both)."""
    _seen(outcome)


def _check_start_bound(outcome: Outcome, mode: str) -> None:
    if mode == "Workers(...)":  # spawned ranks importing torch take far longer
        _raised(LaunchTimeoutError, "did not finish starting within rdzv_timeout=0.05 s")(outcome, mode)
    else:
        _seen(outcome)


def _check_seed(outcome: Outcome, mode: str) -> None:
    """Rank 0 drew from torch seeded with (seed, rank 0), as ``seed_all`` seeds it."""
    import torch

    from mplaunch._state.snapshot import derived_seed

    expected = torch.rand(1, generator=torch.Generator().manual_seed(derived_seed(7, 0))).item()
    assert _seen(outcome)["draw"] == expected, outcome.value


PROBES: dict[str, Probe] = {
    "nprocs": Probe(1, _check_world(1, 4), values={"multi-node": 2}),
    "start_method": Probe("spawn", _check_spawned),
    "return_all": Probe(True, _check_all),
    "timeout": Probe(1.0, _check_timeout, workers.stuck_here, lambda d: (30.0,)),
    "stall_timeout": Probe(0.5, _raised(StallError, "rank 1"), workers.beat_then_fall_silent, lambda d: (1, 3, 0.05)),
    "grace_period": Probe(0.2, _check_grace, workers.ignore_stops_and_sleep, lambda d: (30.0,), extra={"timeout": 1.0}),
    "backend": Probe("gloo", lambda outcome, mode: None if _seen(outcome)["backend"] == "gloo" else pytest.fail("no")),
    "prefix_output": Probe(True, _check_prefix),
    "console_ranks": Probe([0], _check_console),
    "log_dir": Probe("logs", _check_log),
    "nnodes": Probe(2, _check_world(2, 2), values={"call": 1, "submit()": 1}),
    "node_rank": Probe(0, _check_accepted),
    "rdzv_endpoint": Probe("127.0.0.1:29400", _check_accepted),
    "max_restarts": Probe(1, _check_restarted, workers.fail_once, lambda d: (str(d), "value")),
    "rdzv_timeout": Probe(
        30.0,
        _check_start_bound,
        values={"Workers(...)": 0.05},
        extras={"Workers(...)": {"start_method": "spawn"}},
    ),
    "devices": Probe(1, _check_devices),
    "cpu_binding": Probe("cores", _check_bound, extras={"multi-node": {"nprocs": 2}}),
    "env": Probe({"MPLAUNCH_PROBE": "7"}, lambda o, m: None if _seen(o)["env"] == "7" else pytest.fail(str(o))),
    "preempt_signals": Probe(
        (signal.SIGUSR1,),
        _raised(PreemptedError, "SIGUSR1"),
        workers.wait_for_preemption,
        lambda d: (str(d), False),
        during=_ready_then_preempt,
    ),
    "preempt_grace": Probe(
        0.3,
        _check_grace,
        workers.wait_for_preemption,
        lambda d: (str(d), True),
        extra={"preempt_signals": (signal.SIGUSR1,)},
        extras={"submit()": {"preempt_signals": ()}},
        during=_ready_then_preempt,
    ),
    "restart_on": Probe(
        (ValueError,), _check_not_restarted, workers.fail_once, lambda d: (str(d), "key"), {"max_restarts": 1}
    ),
    "restart_delay": Probe(0.5, _check_delay, workers.fail_once, lambda d: (str(d), "value"), {"max_restarts": 1}),
    "post_mortem": Probe(True, _check_post_mortem),
    "seed": Probe(7, _check_seed),
}
NAMES = [field.name for field in dataclasses.fields(ParallelConfig)]


def test_every_option_has_a_probe() -> None:
    assert sorted(PROBES) == sorted(NAMES)


def _cells() -> Iterator[Any]:
    for name in NAMES:
        for mode in MODES:
            marks = [pytest.mark.slow] if mode == "multi-node" else []
            yield pytest.param(name, mode, id=f"{name}-{mode}", marks=marks)


def _refused(name: str, mode: str) -> str | None:
    """Why ``mode`` refuses ``name`` (``None``: it works there), as the table in the docs says."""
    if mode == "Workers.run/submit" and name not in PER_CALL:
        return "Workers.run/submit runs it on ranks that were started"
    return refused_in(mode).get(name)


@pytest.fixture
def pretend_two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees two CUDA devices (the pool's count): ``devices=`` hands them out to the ranks."""
    from mplaunch._parent import devices

    monkeypatch.setattr(devices, "device_count", lambda: 2)


@pytest.mark.parametrize(("name", "mode"), list(_cells()))
def test_each_cell_works_or_is_refused_naming_the_way_of_calling(
    name: str,
    mode: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    pretend_two_devices: None,
    node_outcomes: Callable[[], dict[str, Any]],
) -> None:
    probe = PROBES[name]
    reason = _refused(name, mode)
    if mode == "multi-node" and reason is None:
        result = node_outcomes()[name]
        assert result == "ok", result
        return
    options = probe.options(name, mode, refused=reason is not None)
    if name == "log_dir":
        options[name] = str(tmp_path / "logs")
    monkeypatch.setattr(workers, "INHERITED", "set in the parent")
    outcome = _call_in(mode, options, probe, tmp_path, capsys)
    if reason is None:
        probe.check(outcome, mode)
        return
    assert isinstance(outcome.value, InvalidOptionError), outcome.value
    message = str(outcome.value)
    assert message.startswith(f"{name}="), message
    assert reason in message, message
    named = {"call": "a call", "multi-node": "nnodes=2", "Workers.run/submit": "Workers.run/submit"}.get(mode, mode)
    assert named in message, message


def _call_in(
    mode: str, options: dict[str, Any], probe: Probe, directory: Path, capsys: pytest.CaptureFixture[str]
) -> Outcome:
    """Run the probe with ``options`` in ``mode``; what comes back."""
    capsys.readouterr()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = _run(mode, options, probe, directory)
        except Exception as error:  # noqa: BLE001 - the outcome to check
            value = error
    return Outcome(
        value, time.monotonic() - started, tuple(str(w.message) for w in caught), capsys.readouterr().out, directory
    )


def _run(mode: str, options: dict[str, Any], probe: Probe, directory: Path) -> Any:
    args = probe.args(directory)
    return_all = options.pop("return_all", False)
    preempts: list[Callable[[], None]] = [lambda: os.kill(os.getpid(), signal.SIGUSR1)]
    if probe.during is not None:
        threading.Thread(target=probe.during, args=(directory, 2, lambda: preempts[-1]()), daemon=True).start()
    decorate: Any = parallel(return_all=return_all, **options)
    if mode in ("call", "multi-node"):  # (multi-node: a refusal, before any rendezvous)
        return decorate(probe.function)(*args)
    if mode == "submit()":
        future = decorate(probe.function).submit(*args)
        preempts.append(future.preempt)
        return future.result(TIMEOUT * 2)
    if mode == "generator function":
        stream = decorate(workers.yielding)(probe.function, *args)
        for _ in stream:
            pass
        return stream.value
    if mode == "Workers(...)":
        with Workers(return_all=return_all, **options) as warm:
            return warm.run(probe.function, *args)
    assert mode == "Workers.run/submit"
    with Workers(**BASE) as warm:
        return warm.run(decorate(probe.function), *args)


# The multi-node column: its probes on two nodes of this machine, one launch after the other ---------------

NODE = """
    import io, json, os, signal, sys, threading, time, warnings
    from pathlib import Path
    from mplaunch import parallel
    from mplaunch._parent import devices
    from tests import workers
    from tests.integration import test_option_modes as table

    def run(node, ports, root):
        results = {}
        for name, port in ports.items():
            probe = table.PROBES[name]
            directory = root / f"node{node}-{name}"
            directory.mkdir()
            options = {"rdzv_timeout": 60.0, **probe.options(name, "multi-node"), "rdzv_endpoint": f"127.0.0.1:{port}"}
            if name == "log_dir":
                options[name] = str(directory / "logs")
            return_all = options.pop("return_all", False)
            if probe.during is not None and node == 0:
                preempt = lambda: os.kill(os.getpid(), signal.SIGUSR1)
                threading.Thread(target=probe.during, args=(directory, 1, preempt), daemon=True).start()
            out, real = io.StringIO(), sys.stdout
            started = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sys.stdout = out
                try:
                    value = parallel(return_all=return_all, **options)(probe.function)(*probe.args(directory))
                except Exception as error:
                    value = error
                finally:
                    sys.stdout = real
            warned = tuple(str(w.message) for w in caught)
            outcome = table.Outcome(value, time.monotonic() - started, warned, out.getvalue(), directory)
            try:
                probe.check(outcome, "multi-node")
                results[name] = "ok"
            except BaseException as failure:
                results[name] = f"{type(failure).__name__}: {failure} (outcome {value!r})"
        return results

    if __name__ == "__main__":
        devices.device_count = lambda: 2
        workers.INHERITED = "set in the parent"
        results = run(int(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
        print("results", json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def node_outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Any]]:
    """Run the multi-node column's probes once, on two nodes (processes) of this machine, when a cell first
    asks; each probe's result on node 0 (``"ok"``, or why its check failed)."""
    found: list[dict[str, Any]] = []

    def outcomes() -> dict[str, Any]:
        if not found:
            found.append(_run_nodes(tmp_path_factory.mktemp("nodes")))
        return found[0]

    return outcomes


def _run_nodes(root: Path) -> dict[str, Any]:
    names = [name for name in NAMES if name not in refused_in("multi-node")]
    ports = {name: free_port() for name in names}
    script = write_script(root, NODE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), str(node), json.dumps(ports), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for node in range(2)
    ]
    outputs = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        outputs.append((out, err))
    line = next((line for line in outputs[0][0].splitlines() if line.startswith("results ")), None)
    assert line is not None, outputs
    return dict(json.loads(line.removeprefix("results ")))
