"""Turning the raw samples of a run into table rows, target verdicts, a printed table and a chart.

Every value is a median. A ratio is computed within each round (both sides measured in the same round) and
the median of the per-round ratios is reported.
"""

from __future__ import annotations

import dataclasses
import statistics
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from benchmarks.config import METHOD_ORDER
from benchmarks.runners import RUNNERS, Runner
from benchmarks.workers import PAYLOAD_BYTES

MiB = 1 << 20
LARGE = "512 MiB tensor"
LIST = "list 10**6 ints"


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class Round:
    """Read access to the cells of one round: ``cells["runner/method"]`` and ``baselines``."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.cells: dict[str, dict[str, Any]] = data["cells"]
        self.baselines: dict[str, Any] = data["baselines"]

    def samples(self, runner: str, method: str, section: str) -> list[float]:
        return list(self.cells.get(f"{runner}/{method}", {}).get(section) or [])

    def warm(self, runner: str, method: str, section: str = "launch") -> float | None:
        return _median(self.samples(runner, method, section))

    def first(self, runner: str, method: str) -> float | None:
        return self.cells.get(f"{runner}/{method}", {}).get("first")

    def payload(self, runner: str, method: str, kind: str, field: str) -> list[float | None]:
        cell = self.cells.get(f"{runner}/{method}", {})
        return [sample.get(field) for sample in (cell.get("payload") or {}).get(kind, [])]

    def baseline(self, kind: str) -> float | None:
        return _median((self.baselines.get("payload") or {}).get(kind, {}).get("samples", []))

    def state(self, key: str) -> float | None:
        return (self.baselines.get("state") or {}).get(key)


def raw_peer(method: str) -> str:
    """The raw torch method an mplaunch/peer method is compared with: forkserver against forkserver with
    torch preloaded (mplaunch preloads it too), the others against themselves."""
    return "forkserver+preload" if method == "forkserver" else method


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _per_round(rounds: list[Round], ratio: Callable[[Round], float | None]) -> float | None:
    return _median([ratio(r) for r in rounds])


def _pooled(rounds: list[Round], samples: Callable[[Round], Sequence[float | None]]) -> list[float]:
    return [s for r in rounds for s in samples(r) if s is not None]


def _latency_row(rounds: list[Round], runner: Runner, method: str, section: str) -> dict[str, Any]:
    key = runner.key
    samples = _pooled(rounds, lambda r: r.samples(key, method, section))
    first_is_this = section == "launch" or runner.own_process_group
    return {
        "runner": key,
        "label": runner.label,
        "method": method,
        "first": _median([r.first(key, method) for r in rounds]) if first_is_this else None,
        "median": _median(samples),
        "n": len(samples),
        "ratio": _per_round(
            rounds, lambda r: _ratio(r.warm(key, method, section), r.warm("raw", raw_peer(method), section))
        ),
    }


def latency_rows(rounds: list[Round], section: str) -> list[dict[str, Any]]:
    """Rows of (a) (``section="launch"``) or (c) (``section="gloo"``)."""
    rows = [
        _latency_row(rounds, runner, method, section)
        for method in METHOD_ORDER
        for runner in RUNNERS
        if any(f"{runner.key}/{method}" in r.cells for r in rounds)
        and not (section == "launch" and runner.own_process_group)
    ]
    return [row for row in rows if row["median"] is not None or row["first"] is not None]


def _payload_row(rounds: list[Round], runner: Runner, kind: str) -> dict[str, Any]:
    key, method, nbytes = runner.key, runner.payload_method or "", PAYLOAD_BYTES[kind]

    def pooled(field: str) -> list[float]:
        return _pooled(rounds, lambda r: r.payload(key, method, kind, field))

    times, rss = pooled("ready_to_return"), _median(pooled("rss_increase"))
    return {
        "payload": kind,
        "runner": key,
        "label": f"{runner.label} ({method})",
        "median": _median(times),
        "n": len(times),
        "ratio": _per_round(
            rounds, lambda r: _ratio(_median(r.payload(key, method, kind, "ready_to_return")), r.baseline(kind))
        ),
        "touch": _median(pooled("touch")),
        "rss_increase": rss,
        "rss_ratio": _ratio(rss, nbytes),
    }


def payload_rows(rounds: list[Round]) -> list[dict[str, Any]]:
    """Rows of (b): per payload, the in-process baseline, then every launcher that returns values."""
    rows = []
    for kind, nbytes in PAYLOAD_BYTES.items():
        name = "one shm copy" if nbytes is not None else "pickle round trip"
        baseline = _median([r.baseline(kind) for r in rounds])
        rows.append(
            {"payload": kind, "runner": "baseline", "label": name, "median": baseline, "ratio": 1.0, "n": len(rounds)}
        )
        rows += [
            _payload_row(rounds, runner, kind)
            for runner in RUNNERS
            if runner.payload_method and any(f"{runner.key}/{runner.payload_method}" in r.cells for r in rounds)
        ]
    return rows


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal from the project's issue: ``measure(rounds)`` compared with ``limit``."""

    text: str
    measure: Callable[[list[Round], dict[str, Any]], float | None]
    limit: float
    at_most: bool = True  # value <= limit passes (else value >= limit)
    unit: str = "x"

    def verdict(self, rounds: list[Round], imports: dict[str, Any]) -> dict[str, Any]:
        value = self.measure(rounds, imports)
        if value is None:
            status = "N/A"
        else:
            status = "PASS" if (value <= self.limit if self.at_most else value >= self.limit) else "MISS"
        return {
            "target": self.text,
            "value": value,
            "limit": self.limit,
            "at_most": self.at_most,
            "unit": self.unit,
            "status": status,
        }


def _launch_ratio(method: str, raw_method: str) -> Callable[[list[Round], dict[str, Any]], float | None]:
    return lambda rounds, _: _per_round(rounds, lambda r: _ratio(r.warm("mplaunch", method), r.warm("raw", raw_method)))


def _payload_ratio(kind: str) -> Callable[[list[Round], dict[str, Any]], float | None]:
    return lambda rounds, _: _per_round(
        rounds, lambda r: _ratio(_median(r.payload("mplaunch", "fork", kind, "ready_to_return")), r.baseline(kind))
    )


def _rss_ratio(rounds: list[Round], _: dict[str, Any]) -> float | None:
    increase = _median(_pooled(rounds, lambda r: r.payload("mplaunch", "fork", LARGE, "rss_increase")))
    return _ratio(increase, PAYLOAD_BYTES[LARGE])


def _spawn_over_forkserver(rounds: list[Round], _: dict[str, Any]) -> float | None:
    return _per_round(rounds, lambda r: _ratio(r.warm("mplaunch", "spawn"), r.warm("mplaunch", "forkserver")))


def _import_ms(rounds: list[Round], imports: dict[str, Any]) -> float | None:
    value = imports.get("mplaunch_after_torch")
    return None if value is None else value * 1e3


def _state_ms(rounds: list[Round], _: dict[str, Any]) -> float | None:
    value = _median([r.state("capture_restore") for r in rounds])
    return None if value is None else value * 1e3


TARGETS = (
    Target("fork warm launch <= 1.5x raw fork", _launch_ratio("fork", "fork"), 1.5),
    Target(
        "forkserver warm launch <= 1.3x raw forkserver+preload", _launch_ratio("forkserver", "forkserver+preload"), 1.3
    ),
    Target("forkserver warm launch >= 20x faster than spawn", _spawn_over_forkserver, 20.0, at_most=False),
    Target("spawn warm launch <= 1.05x raw spawn", _launch_ratio("spawn", "spawn"), 1.05),
    Target("512 MiB tensor ready->result <= 1.3x one shm copy", _payload_ratio(LARGE), 1.3),
    Target("512 MiB tensor parent peak RSS increase <= 1.2x size", _rss_ratio, 1.2),
    Target("list of 10**6 ints ready->result <= 1.3x pickle round trip", _payload_ratio(LIST), 1.3),
    Target("import mplaunch adds < 50 ms on top of torch", _import_ms, 50.0, unit="ms"),
    Target("GlobalState.capture().restore(), nothing different, < 5 ms", _state_ms, 5.0, unit="ms"),
)


def summarize(raw_rounds: list[dict[str, Any]], imports: dict[str, Any]) -> dict[str, Any]:
    """Rows of every table and the verdict of every target."""
    rounds = [Round(r) for r in raw_rounds]
    return {
        "launch": latency_rows(rounds, "launch"),
        "gloo": latency_rows(rounds, "gloo"),
        "payload": payload_rows(rounds),
        "imports": imports,
        "state": {key: _median([r.state(key) for r in rounds]) for key in ("capture_restore", "capture", "restore")},
        "targets": [target.verdict(rounds, imports) for target in TARGETS],
    }


# ---------------------------------------------------------------- text


def _s(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.1e}" if 0 < abs(value) < 10**-digits else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x" if value < 100 else f"{value:.0f}x"


def _latency_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"  {'launcher':<16}{'method':<20}{'first s':>9}{'median s':>10}{'n':>4}{'x raw':>9}"]
    for row in rows:
        lines.append(
            f"  {row['label']:<16}{row['method']:<20}{_s(row['first']):>9}{_s(row['median']):>10}"
            f"{row['n']:>4}{_x(row['ratio']):>9}"
        )
    return lines


def _payload_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"  {'payload':<17}{'launcher':<26}{'ready->ret s':>13}{'x base':>10}{'touch s':>9}"
        f"{'peak RSS+ MiB':>15}{'x size':>8}{'n':>4}"
    ]
    for row in rows:
        rss = row.get("rss_increase")
        lines.append(
            f"  {row['payload']:<17}{row['label']:<26}{_s(row['median'], 4):>13}{_x(row['ratio']):>10}"
            f"{_s(row.get('touch'), 4):>9}{'-' if rss is None else f'{rss / MiB:.1f}':>15}"
            f"{_x(row.get('rss_ratio')):>8}{row['n']:>4}"
        )
    return lines


def format_report(summary: dict[str, Any], notes: list[str]) -> str:
    imports, state = summary["imports"], summary["state"]
    lines = [
        "",
        "(a) launch latency, trivial function, nprocs=2 (x raw: warm median / raw torch.mp warm median,"
        " same method, forkserver vs forkserver+preload, same round)",
    ]
    lines += _latency_table(summary["launch"])
    lines += [
        "",
        "(b) result return from rank 0: ready->ret = time.time() in rank 0 before returning -> call returned"
        " in the parent; x base: vs the in-process baseline; touch: reading every page afterwards;"
        " peak RSS+: the parent's peak RSS increase, result touched",
    ]
    lines += _payload_table(summary["payload"])
    lines += [
        "",
        "(c) launch that sets up and tears down a gloo process group (Fabric and ignite always do;"
        " their 'first' is the process's first launch)",
    ]
    lines += _latency_table(summary["gloo"])
    lines += [
        "",
        f"import mplaunch after import torch: {_s(_ms(imports.get('mplaunch_after_torch')), 1)} ms "
        f"(median of {imports.get('n', 0)} fresh interpreters; import torch itself "
        f"{_s(imports.get('torch'), 2)} s)",
        f"GlobalState.capture().restore(), nothing different: {_s(_ms(state['capture_restore']), 3)} ms "
        f"(capture {_s(_ms(state['capture']), 3)} ms, restore {_s(_ms(state['restore']), 3)} ms)",
        "",
        "targets",
    ]
    for target in summary["targets"]:
        value = target["value"]
        shown = "-" if value is None else (f"{value:.1f} ms" if target["unit"] == "ms" else f"{value:.2f}x")
        lines.append(f"  {target['status']:<5} {target['target']:<62} measured {shown}")
    lines += [""] + [f"note: {note}" for note in notes]
    return "\n".join(lines)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# ---------------------------------------------------------------- chart


def draw_chart(summary: dict[str, Any], path: str, title: str) -> None:
    """Four panels: (a) warm launch, (c) gloo launch, (b) result return, and the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(15, 10))
    _latency_panel(axes[0][0], summary["launch"], "(a) trivial launch, nprocs=2: warm median")
    _latency_panel(axes[0][1], summary["gloo"], "(c) launch + gloo process group: warm median")
    _payload_panel(axes[1][0], summary["payload"])
    _targets_panel(axes[1][1], summary["targets"])
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _grouped_bars(axis: Any, groups: list[str], series: dict[str, dict[str, float]]) -> None:
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [values.get(group, 0.0) or 0.0 for group in groups]
        bars = axis.bar(xs, heights, width, label=name)
        for bar, height in zip(bars, heights, strict=True):
            if height:
                axis.annotate(
                    f"{height:.3g}",
                    (bar.get_x() + bar.get_width() / 2, height),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                )
    axis.set_xticks(range(len(groups)))
    axis.set_xticklabels(groups)
    axis.set_yscale("log")
    axis.legend(fontsize=7)


def _latency_panel(axis: Any, rows: list[dict[str, Any]], title: str) -> None:
    methods = [m for m in METHOD_ORDER if any(row["method"] == m for row in rows)]
    series: dict[str, dict[str, float]] = {}
    for row in rows:
        series.setdefault(row["label"], {})[row["method"]] = row["median"]
    _grouped_bars(axis, methods, series)
    axis.set_title(title)
    axis.set_ylabel("seconds (log)")


def _payload_panel(axis: Any, rows: list[dict[str, Any]]) -> None:
    payloads = list(dict.fromkeys(row["payload"] for row in rows))
    series: dict[str, dict[str, float]] = {}
    for row in rows:
        name = "baseline (shm copy / pickle)" if row["runner"] == "baseline" else row["label"]
        series.setdefault(name, {})[row["payload"]] = row["median"]
    _grouped_bars(axis, payloads, series)
    axis.set_ylim(bottom=1e-4)  # the int's pickle round trip (microseconds) is in the table
    axis.set_title("(b) result return: ready in rank 0 -> call returned")
    axis.set_ylabel("seconds (log)")
    axis.tick_params(axis="x", labelsize=8)


def _targets_panel(axis: Any, targets: list[dict[str, Any]]) -> None:
    names, scores, colours = [], [], []
    for target in targets:
        if target["value"] is None:
            continue
        score = target["value"] / target["limit"] if target["at_most"] else target["limit"] / target["value"]
        shown = f"{target['value']:.1f} ms" if target["unit"] == "ms" else f"{target['value']:.2f}x"
        names.append(textwrap.fill(f"{target['target']} ({shown})", 38))
        scores.append(score)
        colours.append("tab:green" if target["status"] == "PASS" else "tab:red")
    axis.barh(range(len(names)), scores, color=colours)
    axis.axvline(1.0, color="black", linewidth=1)
    axis.set_yticks(range(len(names)))
    axis.set_yticklabels(names, fontsize=7)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_title("targets: measured / limit (left of the line passes)")
