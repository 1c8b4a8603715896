"""Moving Python objects with tensors between the parent and its workers through files in shared memory.

An object is pickled once; the bytes of every tensor storage it holds go to a file of their own in a
directory on a RAM-backed file system (``/dev/shm`` where there is one), and the pickle refers to them by
index (as ``torch.save`` does with ``persistent_id``). The reader maps each file as the storage of its tensors:

* a *result* (worker to parent) is mapped shared and its files are unlinked at once, so it costs one copy
  (the writer's), stays valid after the writer exits, and nothing is left on disk;
* a *payload* (parent to workers) is written once and mapped private (copy-on-write) by every worker, so
  workers never see each other's in-place updates, start-up does not grow with the argument size, and a
  mapped storage holds no open file descriptor.

Nothing here flows through a pipe, so no size can fill a pipe buffer and deadlock a join.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
import types
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle_fast
import torch

from mplaunch._importable import WorkerImports

#: Storages smaller than this many bytes travel inside the pickle instead of in a file of their own.
INLINE_BYTES = 64 * 1024

_PICKLE_ERRORS = (pickle.PicklingError, AttributeError, TypeError)


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A zero-copy byte view of a CPU storage."""
    if storage.nbytes() == 0:
        return memoryview(b"")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


class _StorageWriter:
    """The storage half of a pickler: records every storage once, in the order first seen, and pickles a
    reference to it. It hooks ``reducer_override``, which pickle consults only for objects that are not
    builtin containers or atoms, so a list of a million ints costs nothing extra (``persistent_id`` would
    be a Python call per object)."""

    inline_bytes = INLINE_BYTES

    def _init_storages(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self._seen: dict[int, int] = {}

    def _reduce_storage(self, obj: object) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return NotImplemented
        if untyped.device.type == "meta":
            return NotImplemented
        key = untyped._cdata
        if key in self._seen:
            return (_rebuild_storage, ("ref", self._seen[key], dtype, None))
        if untyped.device.type != "cpu":
            untyped = untyped.cpu()
        index = len(self.storages)
        self._seen[key] = index
        self.storages.append(untyped)
        nbytes = untyped.nbytes()
        if nbytes < self.inline_bytes:
            return (_rebuild_storage, ("inline", index, dtype, bytes(_storage_bytes(untyped))))
        return (_rebuild_storage, ("file", index, dtype, nbytes))


class _NeedsValue(pickle.PicklingError):
    """A function or class that the reader cannot import by name: the object must be pickled by value."""


class _Pickler(_StorageWriter, pickle.Pickler):
    """Pickles by reference, like ``pickle``; storages are recorded, not copied. Given ``imports`` (what the
    reader can import), a function or class the reader cannot import raises :class:`_NeedsValue`."""

    def __init__(self, file: io.BytesIO, imports: WorkerImports | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._init_storages()
        self._imports = imports

    def reducer_override(self, obj: Any) -> Any:
        if self._imports is not None and isinstance(obj, (types.FunctionType, type)):
            if self._imports.needs_value(obj):
                raise _NeedsValue(f"{obj!r} cannot be imported by name in the reader")
        return self._reduce_storage(obj)


class _CloudPickler(_StorageWriter, cloudpickle.Pickler):  # type: ignore[misc]
    """Pickles what cannot be imported by the reader (``__main__`` without a file, closures) by value.

    Given ``imports`` (what the reader can import), each function and class is judged by it: by reference
    when the reader imports it by name from the same file, else by value, whatever its module is called.
    Without, cloudpickle's own rule applies (by value for ``__main__`` and unimportable objects).
    Open files are refused: cloudpickle would send a copy of their contents, which is never what a
    worker writing to a file wants.
    """

    def __init__(self, file: io.BytesIO, imports: WorkerImports | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._init_storages()
        self._imports = imports

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, io.IOBase):
            raise TypeError(f"cannot pickle an open file ({type(obj).__qualname__}); open it inside the function")
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


def _pickle(
    obj: object, by_value: bool, imports: WorkerImports | None = None
) -> tuple[memoryview, list[torch.UntypedStorage]]:
    """Pickle ``obj``: by reference first (unless ``by_value``), by value with cloudpickle if that fails or
    if it holds a function or class that ``imports`` says the reader cannot import."""
    if not by_value:
        buffer = io.BytesIO()
        pickler: _StorageWriter = _Pickler(buffer, imports)
        try:
            pickler.dump(obj)  # type: ignore[attr-defined]
            return buffer.getbuffer(), pickler.storages
        except _PICKLE_ERRORS:
            pass
    buffer = io.BytesIO()
    cloud_pickler = _CloudPickler(buffer, imports)
    cloud_pickler.dump(obj)
    return buffer.getbuffer(), cloud_pickler.storages


class _InlineCloudPickler(_CloudPickler):
    inline_bytes = 1 << 62


def to_bytes(obj: object) -> bytes:
    """Pickle ``obj`` into one self-contained ``bytes`` object (every storage inline), to send it to
    another machine; by value where needed (cloudpickle)."""
    buffer = io.BytesIO()
    _InlineCloudPickler(buffer).dump(obj)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """Read an object written by :func:`to_bytes`."""
    return _Reader("", "", private=True).load(data)


def pickle_error(obj: object, *, by_value: bool = False, imports: WorkerImports | None = None) -> Exception | None:
    """Return why ``obj`` cannot be sent (the pickling exception), or ``None`` if it can."""
    try:
        _pickle(obj, by_value, imports)
    except Exception as error:  # noqa: BLE001 - the error is the answer
        return error
    return None


def _write_file(path: str, data: memoryview | bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written : written + (1 << 30)])
    finally:
        os.close(fd)


def dump(
    obj: object, directory: str, name: str, *, by_value: bool = False, imports: WorkerImports | None = None
) -> None:
    """Write ``obj`` as ``directory/name.pkl`` plus one ``name.N.bin`` file per storage of 64 KiB or more.

    The ``.pkl`` file appears last and atomically (written aside, then renamed), so a reader that sees it
    sees a complete object. Tensors on other devices are copied to the CPU first. With ``imports`` (what
    the reading workers can import by name), functions and classes they cannot import travel by value.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled even by value.
    """
    data, storages = _pickle(obj, by_value, imports)
    for index, storage in enumerate(storages):
        if storage.nbytes() >= INLINE_BYTES:
            _write_file(os.path.join(directory, f"{name}.{index}.bin"), _storage_bytes(storage))
    staging = os.path.join(directory, f".{name}.pkl")
    _write_file(staging, data)
    os.replace(staging, os.path.join(directory, f"{name}.pkl"))


def remove(directory: str, name: str) -> None:
    """Remove whatever :func:`dump` wrote (or began to write) for ``name``."""
    for entry in os.listdir(directory):
        if entry.startswith((f"{name}.", f".{name}.")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))


def exists(directory: str, name: str) -> bool:
    """Whether a complete object ``name`` has been written to ``directory``."""
    return os.path.exists(os.path.join(directory, f"{name}.pkl"))


class _Reader:
    """Maps the storages of one object being unpickled; :func:`_rebuild_storage` finds it in ``_reading``."""

    def __init__(self, directory: str, name: str, private: bool) -> None:
        self._directory = directory
        self._name = name
        self._private = private
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.files: list[str] = []

    def storage(self, kind: str, index: int, dtype: torch.dtype | None, data: Any) -> Any:
        if kind == "inline":
            storage = torch.UntypedStorage(len(data))
            if data:
                _storage_bytes(storage)[:] = data
            self._storages[index] = storage
        elif kind == "file":
            path = os.path.join(self._directory, f"{self._name}.{index}.bin")
            mapped: Any = torch.UntypedStorage.from_file(path, shared=not self._private, nbytes=data)
            self._storages[index] = mapped
            self.files.append(path)
        # An untyped storage comes back wrapped as bytes, as torch.load returns it (tensors of the newer
        # dtypes, e.g. float8 or uint16, pickle their untyped storage and expect this on rebuild).
        return torch.storage.TypedStorage(
            wrap_storage=self._storages[index], dtype=dtype or torch.uint8, _internal=True
        )

    def load(self, data: bytes) -> Any:
        previous = getattr(_reading, "reader", None)
        _reading.reader = self
        try:
            return pickle.loads(data)
        finally:
            _reading.reader = previous


_reading = threading.local()


def _rebuild_storage(kind: str, index: int, dtype: torch.dtype | None, data: Any) -> Any:
    """Unpickling side of :class:`_StorageWriter`: the storage, from the reader now unpickling."""
    reader: _Reader | None = getattr(_reading, "reader", None)
    if reader is None:
        raise pickle.UnpicklingError("mplaunch storages can only be read with mplaunch._transport.load")
    return reader.storage(kind, index, dtype, data)


def load(directory: str, name: str, *, private: bool, remove: bool) -> Any:
    """Read the object ``name`` written by :func:`dump`.

    Args:
        directory: where it was written.
        name: its name.
        private: map storages copy-on-write (each reader gets its own copy of what it changes) instead of
            shared with the file.
        remove: unlink its files once mapped (the data lives on in the mappings until they are freed).

    Raises:
        Exception: whatever unpickling raises (a class missing in this process, a corrupt file).
    """
    path = os.path.join(directory, f"{name}.pkl")
    with open(path, "rb") as file:
        data = file.read()
    reader = _Reader(directory, name, private)
    try:
        return reader.load(data)
    finally:
        if remove:
            for leftover in [*reader.files, path]:
                try:
                    os.unlink(leftover)
                except FileNotFoundError:
                    pass
