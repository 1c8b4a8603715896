"""Objects that ``multiprocessing`` sends only to a process being started ("start objects").

A ``multiprocessing`` ``Queue``, lock, ``Event``, ``Barrier`` or shared ``Value`` reaches another process
only while that process starts: its reduction calls ``context.assert_spawning``, which raises "... should
only be shared between processes through inheritance" at any other time. A ``Pipe`` connection or a socket
is a descriptor that the starting ``Popen`` duplicates into the child (``reduction.DupFd``); plain pickle
would copy its number, which means nothing in another process. A ``Manager`` proxy pickles anywhere, but
carries its authentication key only to a starting process. ``torch.multiprocessing.spawn(fn, args=...)``
accepts all of these because ``Process.start()`` pickles ``args``.

mplaunch writes the call once, outside any start. So the payload's pickler puts a placeholder in place of
each start object and collects the objects in a list (:class:`StartObjects`); the list travels in the
:class:`~mplaunch._wire.records.WorkerSpec`, which each worker's start pickles, so ``multiprocessing`` sends
the objects as it does for ``mp.spawn``. The worker resolves the placeholders from its list while it reads
the payload. The objects are recognised by type (:func:`kind_of`, once per type and pickle), else, when a
first pickling fails with the "through inheritance" error, by trying each object's own reduction
(:func:`refused_outside_start`).
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing.context
from multiprocessing import reduction
from typing import Any

#: Classes (module, qualified name) whose instances and subclasses' instances travel only with a starting
#: process; matched by name, so no module is imported to recognise them (a class of a module that was never
#: imported has no instances). torch.multiprocessing's queues subclass multiprocessing's.
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

#: What :func:`kind_of` says about a type.
NEVER, ALWAYS, CTYPES = 0, 1, 2


def kind_of(kind: type) -> int:
    """Whether instances of ``kind`` travel only with a starting process: :data:`ALWAYS`, :data:`NEVER`, or
    :data:`CTYPES` (a ctypes object: only one that ``RawValue``/``RawArray`` put in shared memory, see
    :func:`is_start_object`)."""
    for cls in kind.__mro__:
        if (cls.__module__, cls.__qualname__) in _START_CLASSES:
            return ALWAYS
    return CTYPES if issubclass(kind, _CTYPES) else NEVER


def is_start_object(obj: object, kind: int) -> bool:
    """Whether ``obj``, whose type :func:`kind_of` judged ``kind``, travels only with a starting process."""
    if kind != CTYPES:
        return kind == ALWAYS
    wrapper = type(getattr(obj, "_wrapper", None))  # RawValue/RawArray's place in multiprocessing's heap
    return (wrapper.__module__, wrapper.__qualname__) == ("multiprocessing.heap", "BufferWrapper")


def says_start_only(error: BaseException) -> bool:
    """Whether ``error`` is ``multiprocessing``'s refusal to pickle an object outside a process start."""
    return isinstance(error, RuntimeError) and "through inheritance" in str(error)


def refused_outside_start(obj: object) -> bool:
    """Whether ``obj``'s own reduction refuses to run outside a process start (``assert_spawning``): for
    classes that :func:`kind_of` does not know (other libraries built on ``multiprocessing``)."""
    if isinstance(obj, type):
        return False
    try:
        obj.__reduce_ex__(5)
    except Exception as error:  # noqa: BLE001 - only the refusal matters; pickling itself reports the rest
        return says_start_only(error)
    return False


class StartObjects:
    """The start objects that one pickling met, in the order first seen, each once."""

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self._index: dict[int, int] = {}

    def add(self, obj: object) -> int:
        """Record ``obj``; return its index in :attr:`objects`."""
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.objects)
            self.objects.append(obj)
        return index


class _Rehearsal:
    """Stands in for a starting process's ``Popen`` while start objects are pickled to a discarded buffer."""

    class DupFd:
        def __init__(self, fd: int) -> None:
            self.fd = fd

    def duplicate_for_child(self, fd: int) -> int:
        return fd


def rehearse(objects: list[Any]) -> tuple[Any, Exception] | None:
    """Pickle each start object as a worker's start will (``multiprocessing``'s pickler, a process being
    started), without starting one, so that what cannot travel is refused before any worker starts: e.g. a
    lock made in a ``fork`` context, which a ``spawn`` or ``forkserver`` process cannot open. Nothing is
    duplicated or sent. Returns the first object that fails and its error, else ``None``."""
    for obj in objects:
        multiprocessing.context.set_spawning_popen(_Rehearsal())  # type: ignore[arg-type]
        try:
            reduction.ForkingPickler(io.BytesIO(), 5).dump(obj)
        except Exception as error:  # noqa: BLE001 - the error is the answer
            return obj, error
        finally:
            multiprocessing.context.set_spawning_popen(None)
    return None
