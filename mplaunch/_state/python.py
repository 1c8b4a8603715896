"""Capture the parent's warning filters, ``logging``, umask and resource limits, which ``spawn``/``forkserver``
workers miss (or have the server's), and restore them in a worker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import warnings
from typing import Any

from mplaunch._frames import resolve, warn_at_user
from mplaunch._state.logs import LoggingState

_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class PythonState:
    """The parent's warning filters, logging configuration, umask and resource limits; restored where they differ."""

    warning_filters: tuple[Any, ...]
    logging: LoggingState
    umask: int | None
    rlimits: tuple[tuple[int, tuple[int, int]], ...]
    dropped_filters: tuple[str, ...] = dataclasses.field(compare=False, default=())

    @classmethod
    def capture(cls) -> PythonState:
        """Capture the calling process's configuration. Reads only."""
        filters, dropped = _carried_filters()
        return cls(
            warning_filters=filters,
            logging=LoggingState.capture(),
            umask=_umask(),
            rlimits=_rlimits(),
            dropped_filters=dropped,
        )

    def restore(self) -> None:
        """Make the calling process's configuration equal to this snapshot (where the OS allows)."""
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        if filters != list(self.warning_filters):
            filters[:] = self.warning_filters
            getattr(warnings, "_filters_mutated")()  # noqa: B009 - private: invalidates the per-module caches
        self.logging.restore()
        if self.umask is not None:
            os.umask(self.umask)
        for limit, value in self.rlimits:
            if resource.getrlimit(limit) != value:
                # e.g. a hard limit above this process's: keep its own
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(limit, value)

    @property
    def not_carried(self) -> tuple[str, ...]:
        """Describe the handlers and filters a ``spawn``/``forkserver`` worker will not get."""
        return self.logging.not_carried + self.dropped_filters


def warn_not_carried(state: PythonState) -> None:
    """Warn once per process, at the user's line, about each piece a spawn/forkserver worker will not get."""
    new = [item for item in state.not_carried if item not in _warned]
    if not new:
        return
    _warned.update(new)
    warn_at_user(
        "mplaunch: spawn and forkserver workers do not get these parts of the logging and warnings "
        f"configuration (fork workers inherit them): {'; '.join(new)}. Set them up inside the function, or with "
        "mplaunch.register_state(capture, restore).",
        RuntimeWarning,
    )


def _carried_filters() -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """Return the warning filters whose category a worker can import by name, and the others described."""
    kept, dropped = [], []
    for item in warnings.filters:
        category: Any = item[2]
        if resolve(category.__module__, category.__qualname__) is category:
            kept.append(item)
        else:
            dropped.append(f"the warning filter {item[0]!r} for {category.__qualname__} (not importable by name)")
    return tuple(kept), tuple(dropped)


def _umask() -> int | None:
    """Read this process's umask without changing it (Linux); ``None`` where it cannot."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _rlimits() -> tuple[tuple[int, tuple[int, int]], ...]:
    limits = sorted({getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")})
    return tuple((limit, resource.getrlimit(limit)) for limit in limits)
