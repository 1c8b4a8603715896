"""Pickling objects with tensors once (protocol 5; by reference where the reader can import, else cloudpickle),
storages and buffers of :data:`INLINE_BYTES` or more apart from the pickle, start objects as placeholders."""

from __future__ import annotations

import io
import pickle
import threading
import types
from collections.abc import Sequence
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle_fast
import torch

from mplaunch._wire import start_objects as at_start
from mplaunch._wire.importable import WorkerImports
from mplaunch._wire.mappings import map_file, read_file

INLINE_BYTES = 64 * 1024

_PICKLE_ERRORS = (pickle.PicklingError, AttributeError, TypeError)


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """Return a zero-copy byte view of a CPU storage."""
    if storage.nbytes() == 0:
        return memoryview(b"")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


class StorageWriter:
    """The storage half of a pickler (``reducer_override``: ``persistent_id`` would cost a call per object): each
    storage once, start objects (``probe``: judged by their reduction) and ``keep_shared`` storages as placeholders."""

    inline_bytes = INLINE_BYTES

    def __init__(
        self,
        file: io.BytesIO,
        imports: WorkerImports | None = None,
        start_objects: at_start.StartObjects | None = None,
        probe: bool = False,
        keep_shared: bool = False,
    ) -> None:
        self.keep_shared = keep_shared and start_objects is not None
        self._shared_seen: dict[int, int] = {}  # a shared storage -> its index among the start objects
        self.storages: list[torch.UntypedStorage] = []
        self.buffers: list[pickle.PickleBuffer] = []
        self._seen: dict[int, int] = {}
        self.start_objects = start_objects
        self._probe = probe
        self._kinds: dict[type, int] = {}
        self._imports = imports
        super().__init__(file, protocol=5, buffer_callback=self._keep_buffer)  # type: ignore[call-arg] # the pickler's

    def _keep_buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """Keep large buffers out of band (``buffer_callback``: False), others in band."""
        if buffer.raw().nbytes < self.inline_bytes:
            return True
        self.buffers.append(buffer)
        return False

    def _reduce_storage(self, obj: object) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        elif self.start_objects is None or self._kinds.get(type(obj)) == at_start.NEVER:
            return NotImplemented  # (the common case, first: one look-up per object)
        else:
            return self._reduce_start_object(obj)
        if untyped.device.type == "meta":
            return NotImplemented
        key = untyped._cdata
        if self.keep_shared and untyped.device.type == "cpu" and untyped.is_shared():
            if key not in self._shared_seen:
                self._shared_seen[key] = self.start_objects.add(untyped)  # type: ignore[union-attr]
            return (_rebuild_storage, ("shared", self._shared_seen[key], dtype, None))
        if key in self._seen:
            return (_rebuild_storage, ("ref", self._seen[key], dtype, None))
        if untyped.device.type != "cpu":
            untyped = untyped.cpu()
        index = len(self.storages)
        self._seen[key] = index
        self.storages.append(untyped)
        nbytes = untyped.nbytes()
        if nbytes < self.inline_bytes:
            return (_rebuild_storage, ("inline", index, dtype, bytes(storage_bytes(untyped))))
        return (_rebuild_storage, ("file", index, dtype, nbytes))

    def _reduce_start_object(self, obj: object) -> Any:
        """Reduce a start object to its index among ``start_objects``; else ``NotImplemented``."""
        kind = self._kinds.get(type(obj))
        if kind is None:
            kind = self._kinds[type(obj)] = at_start.kind_of(type(obj))
            if kind == at_start.NEVER and self._probe and at_start.refused_outside_start(obj):
                kind = self._kinds[type(obj)] = at_start.ALWAYS
        if kind == at_start.NEVER or not at_start.is_start_object(obj, kind):
            return NotImplemented
        return (_start_object, (self.start_objects.add(obj),))  # type: ignore[union-attr]


class _NeedsValue(pickle.PicklingError):
    """A function or class the reader cannot import by name: pickle by value."""


class _Pickler(StorageWriter, pickle.Pickler):
    """Pickle by reference; raise :class:`_NeedsValue` for what ``imports`` says the reader cannot import."""

    def reducer_override(self, obj: Any) -> Any:
        if self._imports is not None and isinstance(obj, (types.FunctionType, type)):
            if self._imports.needs_value(obj):
                raise _NeedsValue(f"{obj!r} cannot be imported by name in the reader")
        return self._reduce_storage(obj)


class _CloudPickler(StorageWriter, cloudpickle.Pickler):  # type: ignore[misc]
    """Pickle by value what ``imports`` says the reader cannot import; refuse open files (not their contents)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, io.IOBase):
            raise TypeError(
                f"cannot pickle an open file ({type(obj).__qualname__}): pass or return its path (or its data) "
                "and open it where it is used"
            )
        reduced = self._reduce_storage(obj)
        if reduced is not NotImplemented:
            return reduced
        if self._imports is not None and isinstance(obj, (types.FunctionType, type)):
            if self._imports.needs_value(obj):
                if isinstance(obj, type):
                    return cloudpickle.cloudpickle_fast._dynamic_class_reduce(obj)
                return self._dynamic_function_reduce(obj)
            if obj.__module__ == "__main__":
                return NotImplemented  # the worker runs the same script again: by name, as pickle does
        return super().reducer_override(obj)


def pickle_object(
    obj: object,
    by_value: bool,
    imports: WorkerImports | None = None,
    start_objects: bool = False,
    keep_shared: bool = False,
) -> tuple[memoryview, StorageWriter]:
    """Pickle ``obj`` by reference, else (or ``by_value``) by value; return the pickle and the pickler."""
    try:
        found = at_start.StartObjects() if start_objects else None
        return _pickle_once(obj, by_value, imports, found, False, keep_shared)
    except RuntimeError as error:  # a start object of a type not known refused: again, each object probed
        if not (start_objects and at_start.says_start_only(error)):
            raise
    return _pickle_once(obj, by_value, imports, at_start.StartObjects(), True, keep_shared)


def _pickle_once(
    obj: object,
    by_value: bool,
    imports: WorkerImports | None,
    found: at_start.StartObjects | None,
    probe: bool,
    keep_shared: bool,
) -> tuple[memoryview, StorageWriter]:
    if not by_value:
        buffer = io.BytesIO()
        pickler: StorageWriter = _Pickler(buffer, imports, found, probe, keep_shared)
        try:
            pickler.dump(obj)  # type: ignore[attr-defined]
            return buffer.getbuffer(), pickler
        except _PICKLE_ERRORS:
            pass
    buffer = io.BytesIO()
    again = None if found is None else at_start.StartObjects()
    cloud_pickler = _CloudPickler(buffer, imports, again, probe, keep_shared)
    cloud_pickler.dump(obj)
    return buffer.getbuffer(), cloud_pickler


def to_bytes(obj: object) -> bytes:
    """Pickle ``obj`` into self-contained ``bytes`` (everything inline) for another machine."""
    buffer = io.BytesIO()
    pickler = _CloudPickler(buffer)
    pickler.inline_bytes = 1 << 62
    pickler.dump(obj)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """Read an object written by :func:`to_bytes`."""
    return Reader(-1, "private").load(data, [])


def pickle_error(
    obj: object, *, by_value: bool = False, imports: WorkerImports | None = None, start_objects: bool = False
) -> Exception | None:
    """Return why ``obj`` cannot be sent (the pickling exception), or ``None`` if it can."""
    try:
        pickle_object(obj, by_value, imports, start_objects)
    except Exception as error:  # noqa: BLE001 - the error is the answer
        return error
    return None


def unpicklable_part(obj: object, path: str, seen: frozenset[int] = frozenset(), **how: Any) -> str:
    """Return ``path: type`` of the innermost part of ``obj`` (named ``path``) that cannot be pickled (``how``:
    :func:`pickle_error`'s options), e.g. ``result['model'].logger: _thread.lock``; 50 levels at most."""
    seen |= {id(obj)}
    for name, part in _parts(obj) if len(seen) < 50 else ():
        if id(part) not in seen and pickle_error(part, **how) is not None:
            return unpicklable_part(part, path + name, seen, **how)
    return f"{path}: {type(obj).__module__}.{type(obj).__qualname__}"


def _parts(obj: object) -> list[tuple[str, Any]]:
    """Name what pickling ``obj`` pickles: items, attributes, a function's globals and closure."""
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{index}]", value) for index, value in enumerate(obj)]
    if isinstance(obj, types.FunctionType):
        names = [name for name in obj.__code__.co_names if name in obj.__globals__]
        cells = zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False)
        return [(f".__globals__[{name!r}]", obj.__globals__[name]) for name in names] + [
            (f"'s closure variable {name}", cell.cell_contents) for name, cell in cells
        ]
    kind = type(obj)
    if kind.__reduce_ex__ is not object.__reduce_ex__ or kind.__reduce__ is not object.__reduce__:
        return []  # pickled its own way: the object itself is the part
    state = getattr(obj, "__dict__", None)
    return [(f".{name}", value) for name, value in state.items()] if isinstance(state, dict) else []


class Reader:
    """Map the storages of one object being unpickled (found by :func:`_rebuild_storage` in ``_reading``)."""

    def __init__(
        self, fd: int, how: str, offsets: dict[int, int] | None = None, start_objects: Sequence[Any] = ()
    ) -> None:
        self._fd = fd
        self._how = how  # "private" (mapped copy-on-write) or "copy" (read)
        self._offsets = offsets or {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.start_objects = start_objects

    def storage(self, kind: str, index: int, dtype: torch.dtype | None, data: Any) -> Any:
        if kind == "inline":
            storage = torch.UntypedStorage(len(data))
            if data:
                storage_bytes(storage)[:] = data
            self._storages[index] = storage
        elif kind == "file":
            array = self._piece(self._offsets[index], data)
            self._storages[index] = torch.frombuffer(array, dtype=torch.uint8).untyped_storage()
        # "shared": the user's shared memory, received with this process's start
        untyped = self.start_objects[index] if kind == "shared" else self._storages[index]
        # wrapped as bytes, as torch.load returns it: tensors of newer dtypes (float8) expect this on rebuild
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype or torch.uint8, _internal=True)

    def _piece(self, offset: int, nbytes: int) -> Any:
        if self._how == "copy":
            return read_file(self._fd, offset, nbytes)
        return map_file(self._fd, offset, nbytes)

    def buffers(self, extents: list[tuple[int, int]]) -> list[memoryview]:
        return [memoryview(self._piece(offset, nbytes)).cast("B") for offset, nbytes in extents]

    def load(self, data: Any, buffers: list[memoryview]) -> Any:
        previous = getattr(_reading, "reader", None)
        _reading.reader = self
        try:
            return pickle.loads(data, buffers=buffers)
        finally:
            _reading.reader = previous


_reading = threading.local()


def _rebuild_storage(kind: str, index: int, dtype: torch.dtype | None, data: Any) -> Any:
    """Rebuild a storage recorded by :class:`StorageWriter`, with the reader now unpickling."""
    reader: Reader | None = getattr(_reading, "reader", None)
    if reader is None:
        raise pickle.UnpicklingError("mplaunch storages can only be read with mplaunch._wire.transport.load")
    return reader.storage(kind, index, dtype, data)


def _start_object(index: int) -> Any:
    """Resolve a start object's placeholder from what the reader received with its start."""
    reader: Reader | None = getattr(_reading, "reader", None)
    if reader is None or index >= len(reader.start_objects):
        raise pickle.UnpicklingError(
            "this pickle refers to an object sent with the process start (a queue, lock, Pipe end...) "
            "that the reader was not given"
        )
    return reader.start_objects[index]
