"""Start objects: what ``multiprocessing`` sends only to a process being started (queues, locks, shared values,
``Pipe`` ends, sockets, ``Manager`` proxies). The payload holds placeholders; the objects travel in each
``WorkerSpec``, as ``mp.spawn``'s ``args`` do. Recognised by type, else by their own reduction's refusal."""

from __future__ import annotations

import ctypes
import io
import multiprocessing.context
from multiprocessing import reduction
from typing import Any

# Start classes and their subclasses, matched by (module, qualname): no module is imported to recognise them.
_START_CLASSES = frozenset(
    {
        ("multiprocessing.queues", "Queue"),  # JoinableQueue, torch.multiprocessing.Queue
        ("multiprocessing.queues", "SimpleQueue"),
        ("multiprocessing.synchronize", "SemLock"),  # Lock, RLock, Semaphore, BoundedSemaphore
        ("multiprocessing.synchronize", "Condition"),
        ("multiprocessing.synchronize", "Event"),
        ("multiprocessing.synchronize", "Barrier"),
        ("multiprocessing.sharedctypes", "SynchronizedBase"),  # Value, Array
        ("multiprocessing.connection", "_ConnectionBase"),  # Pipe() ends
        ("multiprocessing.managers", "BaseProxy"),  # Manager().dict(), .list(), .Queue(), ...
        ("socket", "socket"),
    }
)
_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union)

NEVER, ALWAYS, CTYPES = 0, 1, 2


def kind_of(kind: type) -> int:
    """Judge whether ``kind``'s instances are start objects: ALWAYS, NEVER, or CTYPES (only shared ones are)."""
    for cls in kind.__mro__:
        if (cls.__module__, cls.__qualname__) in _START_CLASSES:
            return ALWAYS
    return CTYPES if issubclass(kind, _CTYPES) else NEVER


def is_start_object(obj: object, kind: int) -> bool:
    """Return whether ``obj``, of a type judged ``kind``, is a start object."""
    if kind != CTYPES:
        return kind == ALWAYS
    wrapper = type(getattr(obj, "_wrapper", None))  # RawValue/RawArray's place in multiprocessing's heap
    return (wrapper.__module__, wrapper.__qualname__) == ("multiprocessing.heap", "BufferWrapper")


def says_start_only(error: BaseException) -> bool:
    """Return whether ``error`` is ``multiprocessing``'s refusal to pickle outside a process start."""
    return isinstance(error, RuntimeError) and "through inheritance" in str(error)


def refused_outside_start(obj: object) -> bool:
    """Return whether ``obj``'s own reduction refuses to run outside a process start (``assert_spawning``)."""
    if isinstance(obj, type):
        return False
    try:
        obj.__reduce_ex__(5)
    except Exception as error:  # noqa: BLE001 - only the refusal matters; pickling itself reports the rest
        return says_start_only(error)
    return False


class StartObjects:
    """The start objects one pickling met, each once, in order."""

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self._index: dict[int, int] = {}

    def add(self, obj: object) -> int:
        """Record ``obj``; return its index."""
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.objects)
            self.objects.append(obj)
        return index


class _Rehearsal:
    """Stand in for a starting process's ``Popen`` while start objects are pickled to nowhere."""

    class DupFd:
        def __init__(self, fd: int) -> None:
            self.fd = fd

    def duplicate_for_child(self, fd: int) -> int:
        return fd


def rehearse(objects: list[Any]) -> tuple[Any, Exception] | None:
    """Pickle each start object as a start will, to refuse one that cannot travel first; return it and why."""
    for obj in objects:
        multiprocessing.context.set_spawning_popen(_Rehearsal())  # type: ignore[arg-type]
        try:
            reduction.ForkingPickler(io.BytesIO(), 5).dump(obj)
        except Exception as error:  # noqa: BLE001 - the error is the answer
            return obj, error
        finally:
            multiprocessing.context.set_spawning_popen(None)
    return None
