"""The process-wide pool of CUDA devices that ``devices=`` draws from (after Ray's ``num_gpus`` and Lightning's
``devices=[...]``): launches of one process get disjoint devices, waiting in the order asked unless an earlier
request cannot start yet. Ranks see theirs through ``CUDA_VISIBLE_DEVICES`` under this process's names for them
(index 1 of ``"4,5,6"`` is "5")."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from mplaunch._env import whole_number
from mplaunch._errors import InvalidOptionError
from mplaunch._parent.control import LaunchControl
from mplaunch._platform import cuda, forks

#: Seconds between checks for a stop request while a launch waits for devices.
_POLL = 0.05


def device_count() -> int:
    """Count the CUDA devices seen here without running ``cuInit``: through NVML, else in a throwaway process."""
    if torch.cuda.is_initialized() or torch.version.hip or not torch.cuda._is_compiled():
        return torch.cuda.device_count()  # nothing left to spare, ROCm's own count, or a CPU build's 0
    counted: int = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    return counted if counted >= 0 else cuda.driver_device_count(os.environ.get("CUDA_VISIBLE_DEVICES"))


def fork_refusal() -> tuple[str, str] | None:
    """Say why a worker forked from this process could not use CUDA, and the fix; ``None`` when it could."""
    if torch.cuda._is_in_bad_fork() and device_count() > 0:
        why = "this process was forked from a process that had initialised CUDA"
        return why, "or start this process with spawn (e.g. multiprocessing.get_context('spawn'))"
    if torch.cuda.is_initialized():
        return "CUDA is already initialised in this process", "or use no CUDA here before launching"
    if cuda.driver_initialised():
        return "the CUDA driver is initialised in this process (torch.cuda.is_available() runs cuInit)", (
            "or leave the driver alone until the launch: set PYTORCH_NVML_BASED_CUDA_CHECK=1 before calling "
            "torch.cuda.is_available(), or call torch.cuda.device_count() instead (it asks NVML)"
        )
    return None


def visible_names(environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """Return each visible device's name in this process's ``CUDA_VISIBLE_DEVICES`` (``"0"``, ... unset)."""
    count = device_count()
    entries = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return entries[:count] + [str(index) for index in range(len(entries), count)]


def check_request(devices: int | tuple[int, ...] | None) -> None:
    """Refuse a request this process can never grant, before anything waits or starts."""
    if devices is None:
        return
    names = visible_names()
    visible = ", ".join(f"{index} ({name})" for index, name in enumerate(names)) or "none"
    if isinstance(devices, int):
        if devices > 0 and not names:
            raise InvalidOptionError(
                f"devices={devices} asks for CUDA devices, and this process sees none (no GPU, a CPU build of "
                "torch, or CUDA_VISIBLE_DEVICES empty). Leave devices=None to run on the CPU."
            )
        if devices > len(names):
            raise InvalidOptionError(
                f"devices={devices} asks for more CUDA devices than this process sees ({len(names)}; visible: "
                f"{visible}). Pass at most {len(names)}, or devices=None."
            )
        return
    unknown = [index for index in devices if index >= len(names)]
    if unknown:
        raise InvalidOptionError(
            f"devices={list(devices)} names device(s) {unknown} that this process does not see: the visible "
            f"devices are {visible} (indices count from 0 within CUDA_VISIBLE_DEVICES). Pass indices among them."
        )


class _Ticket:
    """One waiting request (compared by identity: two requests for one device are two tickets)."""

    __slots__ = ("request",)

    def __init__(self, request: int | tuple[int, ...]) -> None:
        self.request = request


class DevicePool:
    """Hand out device indices, each to at most one launch at a time."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._busy: set[int] = set()
        self._waiting: list[_Ticket] = []

    def busy(self) -> frozenset[int]:
        """Return the indices held by running launches now."""
        with self._condition:
            return frozenset(self._busy)

    def _fit(self, request: int | tuple[int, ...], count: int) -> tuple[int, ...] | None:
        if isinstance(request, int):
            free = [index for index in range(count) if index not in self._busy]
            return tuple(free[:request]) if len(free) >= request else None
        return None if self._busy & set(request) else request

    def acquire(self, request: int | tuple[int, ...], control: LaunchControl | None = None) -> tuple[int, ...]:
        """Wait until ``request`` (a count or indices) fits, take and return its devices; ``control`` may stop it."""
        check_request(request)
        count = device_count()
        ticket = _Ticket(request if isinstance(request, int) else tuple(request))
        with self._condition:
            self._waiting.append(ticket)
            try:
                while True:
                    earlier = self._waiting[: self._waiting.index(ticket)]
                    granted = self._fit(ticket.request, count)
                    if granted is not None and all(self._fit(t.request, count) is None for t in earlier):
                        self._busy.update(granted)
                        return granted
                    if control is not None:
                        control.check()
                    self._condition.wait(_POLL if control is not None else None)
            finally:
                self._waiting = [t for t in self._waiting if t is not ticket]
                self._condition.notify_all()  # a later request may fit now

    def release(self, granted: tuple[int, ...]) -> None:
        """Give back devices taken by :meth:`acquire`."""
        with self._condition:
            self._busy.difference_update(granted)
            self._condition.notify_all()


_POOL_LOCK = forks.new_lock()
_pool: tuple[int, DevicePool] | None = None  # (the pid that made it, the pool)


def pool() -> DevicePool:
    """Return this process's pool, made anew in a forked child (its parent's launches are not its own)."""
    global _pool
    with _POOL_LOCK:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), DevicePool())
        return _pool[1]


@contextlib.contextmanager
def held(request: int | tuple[int, ...] | None, control: LaunchControl | None = None) -> Iterator[list[str] | None]:
    """Hold the devices of ``request`` (``None``: all, not pooled) and yield their ``CUDA_VISIBLE_DEVICES`` names."""
    if request is None:
        yield None
        return
    devices = pool()
    granted = devices.acquire(request, control)
    try:
        names = visible_names()
        yield [names[index] for index in granted]
    finally:
        devices.release(granted)


def bus_ids(names: list[str]) -> list[str | None]:
    """Return each named device's PCI bus id from NVML, else ``None`` (an index only under ``PCI_BUS_ID`` order)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: no bus ids
        return [None] * len(names)
    by_index = os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    found: list[str | None] = []
    try:
        for name in names:
            try:
                if name.startswith(("GPU-", "MIG-")):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(name)
                elif by_index and (index := whole_number(name)) is not None:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                else:
                    found.append(None)
                    continue
                bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
                found.append((bus.decode() if isinstance(bus, bytes) else str(bus)).lower()[-12:])
            except Exception:  # noqa: BLE001 - this device is not known to NVML
                found.append(None)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return found
