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


@contextlib.contextmanager
def section(result: dict[str, Any], name: str) -> Iterator[None]:
    """Record a failure of one part of the cell in ``result["errors"]`` and go on with the next part; stop any
    worker the failed launch left behind first."""
    print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
    try:
        yield
    except Exception as error:  # noqa: BLE001 - a peer failing at runtime is reported, not fatal
        traceback.print_exc()
        result["errors"][name] = f"{type(error).__name__}: {error}".strip()[:300]
        _kill_descendants()


def _kill_descendants() -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=5)


def run_launcher(runner_key: str, method: str, plan: Plan) -> dict[str, Any]:
    """Launch latency (a), gloo launch (c) and, where the launcher returns values, result return (b)."""
    from benchmarks.runners import BY_KEY

    runner = BY_KEY[runner_key]
    result: dict[str, Any] = {"runner": runner_key, "method": method, "errors": {}}
    slow = method in runner.slow_methods
    timeout = plan.launch_timeout
    with section(result, "import"):
        runner.prepare()
    if result["errors"]:
        return result

    def launcher(function: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return lambda: runner.launch(method, function, args, timeout)

    first = workers.gloo_cycle if runner.own_process_group else workers.trivial
    with section(result, "first"):
        result["first"] = time_launches(launcher(first), 1, timeout)[0]
    if not runner.own_process_group:
        with section(result, "launch"):
            result["launch"] = time_launches(launcher(workers.trivial), plan.warm_count(slow), timeout)
    with section(result, "gloo"):
        result["gloo"] = time_launches(launcher(workers.gloo_cycle), plan.gloo_count(slow), timeout)
    if runner.payload_method == method:
        result["payload"] = {}
        for kind in workers.PAYLOAD_BYTES:
            if kind in runner.payload_skip:
                result["errors"][f"payload {kind}"] = runner.payload_skip[kind]
                continue
            with section(result, f"payload {kind}"):
                launch = launcher(workers.make_payload, kind)
                samples = [measure_payload(launch, kind, timeout) for _ in range(plan.payload_count(kind))]
                result["payload"][kind] = samples
    return result


def run_baselines(plan: Plan) -> dict[str, Any]:
    """The in-process references of (b), and the cost of capturing and restoring mplaunch's global state."""
    from benchmarks.measure import median_call_seconds, pickle_round_trip_seconds, shm_copy_seconds
    from mplaunch import GlobalState

    result: dict[str, Any] = {"runner": "baselines", "errors": {}, "payload": {}}
    for kind, nbytes in workers.PAYLOAD_BYTES.items():
        value = workers.build_payload(kind)
        measure = shm_copy_seconds if nbytes is not None else pickle_round_trip_seconds
        result["payload"][kind] = {
            "baseline": "one shm copy" if nbytes is not None else "pickle round trip",
            "samples": [measure(value) for _ in range(plan.baseline)],
        }
        del value
    state = GlobalState.capture()
    result["state"] = {
        "capture_restore": median_call_seconds(lambda: GlobalState.capture().restore(), plan.state),
        "capture": median_call_seconds(GlobalState.capture, plan.state),
        "restore": median_call_seconds(state.restore, plan.state),
    }
    return result


def main(argv: list[str]) -> None:
    runner_key, method, plan_json, out = argv
    plan = Plan.from_json(plan_json)
    result = run_baselines(plan) if runner_key == "baselines" else run_launcher(runner_key, method, plan)
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1:])
