"""One benchmark cell, in a fresh process: one launcher with one start method, or the in-process baselines.

``run.py`` starts it as ``python -m benchmarks.cell RUNNER METHOD PLAN_JSON OUT_JSON`` (``RUNNER`` may be
``baselines``) and reads the samples it writes to ``OUT_JSON``. A fresh process per cell makes the first
launch a real first launch (fork server not started, nothing cached) and keeps one launcher's leftovers away
from the next. This module is the ``__main__`` that spawn and forkserver workers import, so its module-level
imports are kept light.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import workers
from benchmarks.config import Plan


def time_launches(launch: Callable[[], Any], count: int, timeout: float) -> list[float]:
    """Wall times of ``count`` calls of ``launch``, each under a deadline."""
    from benchmarks.measure import deadline

    samples = []
    for _ in range(count):
        with deadline(timeout):
            start = time.perf_counter()
            launch()
            samples.append(time.perf_counter() - start)
    return samples


def measure_payload(launch: Callable[[], Any], kind: str, timeout: float) -> dict[str, float]:
    """One launch returning payload ``kind``: seconds from the value being ready in rank 0 to the call
    returning here, seconds to touch every page of it, and the increase of this process's peak RSS."""
    import numpy  # noqa: F401 - imported now, not while touching the first result

    from benchmarks.measure import PeakRss, deadline, payload_size_ok, touch

    rss = PeakRss() if PeakRss.supported() else None
    gc.collect()
    before = rss.reset() if rss else 0
    with deadline(timeout):
        ready, value = launch()
        returned = time.time()
    start = time.perf_counter()
    touch(value)
    sample = {"ready_to_return": returned - ready, "touch": time.perf_counter() - start}
    if rss:
        sample["rss_increase"] = rss.peak() - before
    if not payload_size_ok(value, workers.PAYLOAD_BYTES[kind], kind):
        raise RuntimeError(f"the launcher returned {type(value).__name__}, not the {kind} payload")
    return sample


class Recorder:
    """The cell's results, written to ``out`` after every part, so a cell killed at its time limit still
    reports what it measured."""

    def __init__(self, out: str, **fields: Any) -> None:
        self.out = out
        self.result: dict[str, Any] = {**fields, "errors": {}}
        self.started = time.perf_counter()

    def save(self) -> None:
        self.result["cell_seconds"] = time.perf_counter() - self.started
        with open(self.out, "w") as file:
            json.dump(self.result, file)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run one part; record its failure in ``errors`` and go on with the next part, after stopping any
        worker the failed launch left behind."""
        print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
        try:
            yield
        except Exception as error:  # noqa: BLE001 - a peer failing at runtime is reported, not fatal
            traceback.print_exc()
            self.result["errors"][name] = f"{type(error).__name__}: {error}".strip()[:300]
            _kill_descendants()
        finally:
            self.save()


def _kill_descendants() -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=5)


def run_launcher(cell: Recorder, runner_key: str, method: str, plan: Plan) -> None:
    """Launch latency (a), gloo launch (c) and, where the launcher returns values, result return (b)."""
    from benchmarks.runners import BY_KEY

    runner = BY_KEY[runner_key]
    result = cell.result
    slow = method in runner.slow_methods
    timeout = plan.launch_timeout
    with cell.section("import"):
        runner.prepare()
    if result["errors"]:
        return

    def launcher(function: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return lambda: runner.launch(method, function, args, timeout)

    first = workers.gloo_cycle if runner.own_process_group else workers.trivial
    with cell.section("first"):
        result["first"] = time_launches(launcher(first), 1, timeout)[0]
    if not runner.own_process_group:
        with cell.section("launch"):
            result["launch"] = time_launches(launcher(workers.trivial), plan.warm_count(slow), timeout)
    if plan.gloo_count(slow):
        with cell.section("gloo"):
            result["gloo"] = time_launches(launcher(workers.gloo_cycle), plan.gloo_count(slow), timeout)
    if runner.payload_method != method:
        return
    result["payload"] = {}
    for kind in workers.PAYLOAD_BYTES:
        if kind in runner.payload_skip:
            result["errors"][f"payload {kind}"] = runner.payload_skip[kind]
            continue
        with cell.section(f"payload {kind}"):
            launch = launcher(workers.make_payload, kind)
            count = plan.payload_count(kind, runner.peer)
            result["payload"][kind] = [measure_payload(launch, kind, timeout) for _ in range(count)]


def run_baselines(cell: Recorder, plan: Plan) -> None:
    """The in-process references of (b), and the cost of capturing and restoring mplaunch's global state."""
    from benchmarks.measure import median_call_seconds, pickle_round_trip_seconds, shm_copy_seconds
    from mplaunch import GlobalState

    cell.result["payload"] = {}
    for kind, nbytes in workers.PAYLOAD_BYTES.items():
        with cell.section(f"baseline {kind}"):
            value = workers.build_payload(kind)
            measure = shm_copy_seconds if nbytes is not None else pickle_round_trip_seconds
            cell.result["payload"][kind] = {
                "baseline": "one shm copy" if nbytes is not None else "pickle round trip",
                "samples": [measure(value) for _ in range(plan.baseline)],
            }
            del value
    with cell.section("state"):
        state = GlobalState.capture()
        cell.result["state"] = {
            "capture_restore": median_call_seconds(lambda: GlobalState.capture().restore(), plan.state),
            "capture": median_call_seconds(GlobalState.capture, plan.state),
            "restore": median_call_seconds(state.restore, plan.state),
        }


def main(argv: list[str]) -> None:
    runner_key, method, plan_json, out = argv
    plan = Plan.from_json(plan_json)
    cell = Recorder(out, runner=runner_key, method=method)
    if runner_key == "baselines":
        run_baselines(cell, plan)
    else:
        run_launcher(cell, runner_key, method, plan)
    cell.save()


if __name__ == "__main__":
    main(sys.argv[1:])
