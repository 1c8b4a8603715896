"""Benchmark mplaunch against raw ``torch.multiprocessing`` and other launchers, in one run.

Usage: ``python benchmarks/run.py [--quick] [--only [PEER ...]] [--results DIR]``

Every measurement runs in a *cell*, a fresh process with a time limit (``cells.py``): a (launcher, start
method) pair with nprocs=2, or ``baselines``, ``arguments``, ``ddp``, ``output``. A round runs every cell
once; ratios compare cells of the same round. A target whose per-round values are neither stable (the last 3
within 15%) nor clearly (by 15%) on one side of its limit has its cells' parts rerun, up to ``max_rounds``;
if it never settles it is NOISY, not MISS. Missing peers (the ``bench`` extra) are skipped with a note. The
report is printed and saved with every sample to ``benchmarks/results/latest.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import median  # noqa: E402
from benchmarks.launchers import PAYLOADS, RUNNERS  # noqa: E402

METHODS = ("fork", "forkserver", "forkserver+preload", "spawn")
PACKAGES = ("torch", "numpy", "lightning", "accelerate", "pytorch-ignite")
Round = dict[str, dict[str, Any]]


#: rounds of every cell, then reruns of undecided targets' parts up to max_rounds while under budget seconds;
#: warm/gloo launches per cell (*_slow: where workers import torch); payload: launches per result (peers:
#: payload_peers) and samples per baseline; repeats: imports, 400 MB arguments, DDP commands, output runs;
#: state: restore calls; peers_slow: also the peers' spawn cells.
QUICK = dict(rounds=1, max_rounds=4, budget=480, warm=8, warm_slow=2, gloo=3, gloo_slow=0, payload=2, payload_peers=1,
             repeats=1, state=200, peers_slow=False, cell_timeout=300)  # fmt: skip
FULL = dict(rounds=3, max_rounds=6, budget=3600, warm=30, warm_slow=4, gloo=10, gloo_slow=2, payload=5, payload_peers=3,
            repeats=5, state=2000, peers_slow=True, cell_timeout=900)  # fmt: skip


def values(data: Round, path: str) -> list[float]:
    """The samples at ``cell|key|...`` in one round; a last ``.field`` takes that field of each sample."""
    cell, *keys = path.split("|")
    field = keys.pop()[1:] if keys[-1].startswith(".") else None
    value: Any = data.get(cell, {})
    for key in keys:
        value = value.get(key, {}) if isinstance(value, dict) else {}
    value = value if isinstance(value, list) else [value] if isinstance(value, float) else []
    return [sample[field] for sample in value] if field else value


def med(data: Round, path: str) -> float | None:
    return median(values(data, path))


def pooled(rounds: list[Round], path: str) -> float | None:
    return median(v for data in rounds for v in values(data, path))


def div(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


@dataclasses.dataclass(frozen=True)
class Target:
    """``top / bottom`` (paths of :func:`values`, or a number) per round, against ``limit``."""

    text: str
    limit: float
    top: str
    bottom: str | float
    at_most: bool = True
    unit: str = "x"

    def value(self, data: Round) -> float | None:
        return div(med(data, self.top), self.bottom if isinstance(self.bottom, float) else med(data, self.bottom))

    def verdict(self, rounds: list[Round], final: bool) -> tuple[str | None, float | None, list[float]]:
        """PASS/MISS/N/A (NOISY if ``final``, else None: rerun), the median of the last 3 values, all values."""
        found = [v for v in map(self.value, rounds) if v is not None]
        if not found:
            return "N/A", None, found
        last, value = found[-3:], median(found[-3:]) or 0.0
        scores = [v / self.limit if self.at_most else self.limit / max(v, 1e-9) for v in last]
        stable = len(last) == 3 and max(last) <= 1.15 * min(last)
        clear = min(last) >= 0 and (all(s <= 1 / 1.15 for s in scores) or len(last) == 3 and min(scores) >= 1.15)
        status = "PASS" if (value <= self.limit) == self.at_most else "MISS"
        return (status if stable or clear else "NOISY" if final else None), value, found


MP, LIST, BIG, ARRAY = "mplaunch/fork|", "list 10**6 ints", "512 MiB tensor", "400 MB NumPy array"
TARGETS = [Target(*row) for row in (  # text, limit, top, bottom (a path or a number), at_most, unit
    ("fork warm launch <= 1.5x raw fork", 1.5, "mplaunch/fork|launch", "raw/fork|launch"),
    ("fork warm, timeout + stall_timeout <= 1.5x raw fork", 1.5, "mplaunch/fork|watched", "raw/fork|launch"),
    ("forkserver warm <= 1.3x raw preloaded", 1.3, "mplaunch/forkserver|launch", "raw/forkserver+preload|launch"),
    ("forkserver warm >= 20x faster than spawn", 20, "mplaunch/spawn|launch", "mplaunch/forkserver|launch", False),
    ("spawn warm launch <= 1.05x raw spawn", 1.05, "mplaunch/spawn|launch", "raw/spawn|launch"),
    (f"{BIG} ready->result <= 1.3x one shm copy", 1.3, f"{MP}{BIG}|.ret", f"baselines|{BIG}"),
    (f"{BIG} parent peak RSS increase <= 1.2x size", 1.2, f"{MP}{BIG}|.rss", 512.0 * 2**20),
    ("list of 10**6 ints ready->result <= 1.3x pickle", 1.3, f"{MP}{LIST}|.ret", f"baselines|{LIST}"),
    ("import mplaunch adds < 50 ms on top of torch", 50, "baselines|imports|mplaunch", 1e-3, True, "ms"),
    ("GlobalState.capture().restore() < 5 ms", 5, "baselines|state", 1e-3, True, "ms"),
    ("DDP script, DataLoader(num_workers=2), spawn <= 1.3x torchrun", 1.3, "ddp|wall|mplaunch", "ddp|wall|torchrun"),
    (f"{ARRAY} result ready->result <= 1.3x one copy", 1.3, f"{MP}{ARRAY}|.ret", f"baselines|{ARRAY}"),
    (f"{ARRAY} result parent peak RSS <= 1.1x data", 1.1, f"{MP}{ARRAY}|.rss", 400e6),
    (f"{ARRAY} argument (spawn) adds <= 1.3 one-copies", 1.3, f"arguments|{ARRAY}|extra", f"baselines|{ARRAY}"),
    (f"{ARRAY} argument (spawn) parent peak <= 1.1x data", 1.1, f"arguments|{ARRAY}|rss", 400e6),
    ("fork, 4 MiB bytes argument <= 1.2x raw", 1.2, "arguments|4 MiB bytes|mplaunch", "arguments|4 MiB bytes|raw"),
    (f"fork, {LIST} argument <= 1.2x raw", 1.2, f"arguments|{LIST}|mplaunch", f"arguments|{LIST}|raw"),
    ("fork warm, 2 ranks <= 1.3x the floor (2 bare forks)", 1.3, "floor|fork 2|mplaunch", "floor|fork 2|floor"),
    ("fork warm, 8 ranks <= 1.3x the floor (8 bare forks)", 1.3, "floor|fork 8|mplaunch", "floor|fork 8|floor"),
    ("fork warm, 32 ranks <= 1.3x the floor (32 bare forks)", 1.3, "floor|fork 32|mplaunch", "floor|fork 32|floor"),
    ("return path, last return -> values held, 2 ranks < 1 ms", 1, "floor|return|mplaunch_return", 1e-3, True, "ms"),
    ("return path, 2 ranks <= 1.3x the floor's", 1.3, "floor|return|mplaunch_return", "floor|return|floor_return"),
    ("warm Workers.run(), no-op, 2 ranks (fork) <= 2 ms", 2, "interactive|warm|run", 1e-3, True, "ms"),
    ("yield in a rank -> value in the caller <= 10 ms", 10, "interactive|warm|yield", 1e-3, True, "ms"),
    ("heartbeat() in a rank <= 2 us", 2, "interactive|heartbeat", 1e-6, True, "us"),
    ("GPU: spawn, ranks initialise CUDA <= 1.05x torch.mp.spawn", 1.05, "gpu|spawn|mplaunch", "gpu|spawn|raw"),
    ("GPU: 1 GiB CUDA result ready->ret <= 1.3x t.cpu() + a copy", 1.3, "gpu|result|.ret", "gpu|result|.base"),
)]  # fmt: skip


def run_cell(name: str, parts: list[str], plan: dict[str, Any], label: str, logs: Path) -> dict[str, Any]:
    """Run one cell in a fresh process and session; kill what it leaves behind (reported as an error)."""
    out = logs / f"{label}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.cells", name, json.dumps(plan), str(out), *parts]
    with open(logs / f"{label}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        try:
            process.wait(timeout=plan["cell_timeout"])
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"errors": {}}
    if process.returncode:
        result["errors"]["cell"] = f"exit code {process.returncode} (-9: killed at its time limit); see {label}.log"
    for _ in range(30):  # fork servers and resource trackers exit on their own just after their parent
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return result
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    result["errors"]["leftovers"] = "processes of the cell were alive 3 s after it ended; killed"
    return result


def run_rounds(plan: dict[str, Any], cells: list[str], logs: Path, notes: list[str]) -> list[Round]:
    """``plan["rounds"]`` rounds of every cell, then rounds of the cells of targets not yet decided."""
    started, rounds = time.perf_counter(), []
    todo: dict[str, list[str]] = dict.fromkeys(cells, [])
    while todo:
        data = {}
        for name, parts in todo.items():
            data[name] = run_cell(name, parts, plan, f"r{len(rounds)}-{name.replace('/', '-')}", logs)
            errors = "; ".join(f"{k}: {v}" for k, v in data[name]["errors"].items()) or "ok"
            print(f"[{time.perf_counter() - started:4.0f} s] {len(rounds) + 1} {name} {parts}: {errors}", flush=True)
        rounds.append(data)
        if len(rounds) < plan["rounds"]:
            continue
        todo = {}
        if len(rounds) < plan["max_rounds"] and time.perf_counter() - started < plan["budget"]:
            undecided = [t for t in TARGETS if t.verdict(rounds, final=False)[0] is None]
            for path in (p for t in undecided for p in (t.top, t.bottom) if isinstance(p, str)):
                cell, part, *_ = path.split("|")
                todo[cell] = [*dict.fromkeys([*todo.get(cell, []), part])]
    notes.append(f"{len(rounds)} round(s) in {time.perf_counter() - started:.0f} s")
    return rounds


def fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    shown = {
        "s": f"{value:.3f}",
        "ms": f"{value:.1f} ms",
        "us": f"{value:.2f} us",
        "MiB": f"{value / 2**20:.0f}",
        "x": f"{value:.2f}x",
    }[unit]
    return f"{value:.0f}x" if unit == "x" and value >= 100 else shown


def latency_table(rounds: list[Round], part: str) -> list[str]:
    lines = [f"  {'launcher':<16}{'method':<20}{'first s':>9}{'median s':>10}{'n':>4}{'x raw':>8}"]
    for method in METHODS:
        raw = "raw/forkserver+preload" if method == "forkserver" else f"raw/{method}"  # mplaunch preloads torch
        for runner in RUNNERS:
            cell = f"{runner.key}/{method}"
            first = pooled(rounds, f"{cell}|first") if (part == "gloo") == runner.own_group else None
            n = sum(len(values(data, f"{cell}|{part}")) for data in rounds)
            ratio = median(div(med(data, f"{cell}|{part}"), med(data, f"{raw}|{part}")) for data in rounds)
            if n or first is not None:
                warm = fmt(pooled(rounds, f"{cell}|{part}"))
                lines.append(f"  {runner.label:<16}{method:<20}{fmt(first):>9}{warm:>10}{n:>4}{fmt(ratio, 'x'):>8}")
    return lines


def payload_table(rounds: list[Round]) -> list[str]:
    lines = [f"  {'payload':<19}{'launcher':<24}{'ready->ret s':>13}{'x base':>8}{'touch s':>9}{'peak RSS+ MiB':>15}"]
    for kind in PAYLOADS:
        base, name = f"baselines|{kind}", "pickle round trip" if kind in ("int", LIST) else "one shm copy"
        lines.append(f"  {kind:<19}{name:<24}{fmt(pooled(rounds, base)):>13}")
        for runner in (r for r in RUNNERS if r.payloads):
            at = f"{runner.key}/{runner.payloads}|{kind}|."
            ratio = median(div(med(data, at + "ret"), med(data, base)) for data in rounds)
            if pooled(rounds, at + "ret") is not None:
                time_, touch, rss = (pooled(rounds, at + field) for field in ("ret", "touch", "rss"))
                lines.append(f"  {'':<19}{f'{runner.label} ({runner.payloads})':<24}{fmt(time_):>13}"
                             f"{fmt(ratio, 'x'):>8}{fmt(touch):>9}{fmt(rss, 'MiB'):>15}")  # fmt: skip
    return lines


DETAILS = (  # the lines of (d): a label, then the paths of the seconds it shows
    ("fork, 4 MiB bytes argument: mplaunch / raw", "arguments|4 MiB bytes|mplaunch", "arguments|4 MiB bytes|raw"),
    (f"fork, {LIST} argument: mplaunch / raw", f"arguments|{LIST}|mplaunch", f"arguments|{LIST}|raw"),
    ("spawn, a 1-byte NumPy argument / what 400 MB add", f"arguments|{ARRAY}|small", f"arguments|{ARRAY}|extra"),
    ("DDP script, whole command: @parallel spawn / torchrun", "ddp|wall|mplaunch", "ddp|wall|torchrun"),
    ("a rank printing 100 MB: routing off / on (prefix_output)", "output|off|write", "output|on|write"),
    ("its launch: routing off / on", "output|off|launch", "output|on|launch"),
    ("import torch / then import mplaunch", "baselines|imports|torch", "baselines|imports|mplaunch"),
    ("fork warm, 2 ranks: mplaunch / the floor", "floor|fork 2|mplaunch", "floor|fork 2|floor"),
    ("fork warm, 8 ranks: mplaunch / the floor", "floor|fork 8|mplaunch", "floor|fork 8|floor"),
    ("fork warm, 32 ranks: mplaunch / the floor", "floor|fork 32|mplaunch", "floor|fork 32|floor"),
    ("return path, 2 ranks: mplaunch / the floor", "floor|return|mplaunch_return", "floor|return|floor_return"),
    ("GPU, spawn, ranks using CUDA: mplaunch / torch.mp.spawn", "gpu|spawn|mplaunch", "gpu|spawn|raw"),
    ("GPU, 1 GiB CUDA result: ready->ret / t.cpu() + one copy", "gpu|result|.ret", "gpu|result|.base"),
)  # fmt: skip


def report(rounds: list[Round], verdicts: list[dict[str, Any]], notes: list[str]) -> str:
    lines = ["", "(a) launch latency, trivial function, nprocs=2; x raw: warm median / raw torch.mp's, same round"]
    lines += latency_table(rounds, "launch")
    lines += ["", "(b) result from rank 0: ready->ret = value ready in rank 0 -> call returned; x base: vs the "
              "in-process baseline; touch: reading every page; peak RSS+: the parent's, result touched"]  # fmt: skip
    lines += payload_table(rounds)
    lines += ["", "(c) launch that sets up and tears down a gloo group (Fabric and ignite always do)"]
    lines += latency_table(rounds, "gloo")
    lines += ["", "(d) arguments, a DDP script, output routing, imports, the floor (medians)"]
    lines += [f"  {label:<60}{' / '.join(fmt(pooled(rounds, p)) for p in paths)} s" for label, *paths in DETAILS]
    lines += ["", "targets (median of the last 3 rounds; NOISY: never stable within 15%)"]
    for v in verdicts:
        shown = " ".join(fmt(x, v["unit"]) for x in v["values"])
        lines.append(f"  {v['status']:<6}{v['target']:<64}{fmt(v['value'], v['unit']):>7}   per round: {shown}")
    return "\n".join(lines + [""] + [f"note: {note}" for note in notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer repeats, reruns of noisy cells only")
    parser.add_argument("--only", nargs="*", metavar="PEER", choices=[r.key for r in RUNNERS if r.peer],
                        help="measure only these peers (none if no name is given)")  # fmt: skip
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    plan, notes = QUICK if args.quick else FULL, []
    runners = [r for r in RUNNERS if not (r.peer and args.only is not None and r.key not in args.only)]
    notes += [f"skipped {r.label}: {r.missing()}" for r in runners if r.missing()]
    cells = [f"{r.key}/{m}" for m in METHODS for r in runners if m in r.methods.split() and not r.missing()
             and (plan["peers_slow"] or not r.peer or m not in r.slow.split())]  # fmt: skip
    if os.getloadavg()[0] > 0.5:
        notes.append(f"the machine was busy at the start (load average {os.getloadavg()[0]:.1f})")
    logs = args.results.resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    groups = ["baselines", "arguments", "ddp", "output", "floor", "interactive", "gpu"]
    rounds = run_rounds(plan, [*cells, *groups], logs, notes)
    verdicts = []
    for target in TARGETS:
        status, value, found = target.verdict(rounds, final=True)
        verdicts.append({"target": target.text, "status": status, "value": value, "values": found, "unit": target.unit})
    if not any(values(data, "gpu|spawn|raw") for data in rounds):
        notes.append("GPU rows: N/A, no CUDA device (or a CPU build of torch)")
    for index, data in enumerate(rounds):
        notes += [f"round {index + 1} {cell} {part}: {e}" for cell in data for part, e in data[cell]["errors"].items()]
    versions = {d.name: d.version for d in metadata.distributions() if d.name in PACKAGES}
    results = {"plan": plan, "versions": versions, "rounds": rounds, "targets": verdicts}
    (args.results / "latest.json").write_text(json.dumps({**results, "notes": notes}, indent=1))
    print(report(rounds, verdicts, notes + [f"samples and logs in {args.results}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
