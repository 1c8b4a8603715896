"""Moving Python objects with tensors between the parent and its workers through shared memory.

An object is pickled once (protocol 5). The bytes of every tensor storage of 64 KiB or more, and every
out-of-band buffer of that size (NumPy arrays, :class:`pickle.PickleBuffer`), are written at page-aligned
offsets apart from the pickle, which refers to them by offset. They go to one of two places:

* an anonymous memory file (``memfd_create``, see :func:`mplaunch._wire.fds.memory_file`) that the parent
  made for the purpose and the worker inherited (:func:`dump_fd`, :func:`load_fd`): the data first, then the
  pickle, then a trailer saying where the pickle starts. No file system's size limit counts it, so a
  container's small ``/dev/shm`` does not bound its size;
* where there is no such file, two files in the launch directory (:func:`dump`, :func:`load`): ``name.bin``
  (the data) and ``name.pkl`` (the pickle), on a RAM-backed file system (``/dev/shm`` where there is one).

The reader maps or reads each piece (:mod:`mplaunch._wire.mappings`):

* a *result* (worker to parent) from a memory file is mapped shared and the pickle's pages are cut off the
  file, so it costs one copy (the writer's), stays valid after the writer exits, and is held only by the
  caller's mapping; from a file it is read into the caller's own memory (one more copy) and the files are
  unlinked, so nothing stays charged to the file system once the call returns;
* a *payload* (parent to workers) is written once and mapped private (copy-on-write) by every worker, so
  workers never see each other's in-place updates and start-up does not grow with the argument size.

A mapped storage holds no file descriptor, and it is wrapped as an *ordinary* CPU storage
(``torch.frombuffer``): ``is_shared()`` is false, so ``torch.multiprocessing`` (DataLoader workers, queues)
moves it into shared memory of its own the usual way, and ``share_memory_()`` and ``torch.save`` work. The
mapping is unmapped when the last tensor or array using it is freed. Nothing here flows through a pipe, so
no size can fill a pipe buffer and deadlock a join.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import struct
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

#: Storages and buffers smaller than this many bytes travel inside the pickle instead of in the data file.
INLINE_BYTES = 64 * 1024

_PICKLE_ERRORS = (pickle.PicklingError, AttributeError, TypeError)
_PAGE = mmap.PAGESIZE
_HEADER = struct.Struct("<Q")  # number of out-of-band buffers
_EXTENT = struct.Struct("<QQ")  # offset, size of one out-of-band buffer in the data file
_TRAILER = struct.Struct("<QQ")  # where the pickle starts in a memory file, _MAGIC
_MAGIC = 0x6D706C61756E6368  # "mplaunch": written last, so a memory file that ends with it is complete


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
    be a Python call per object). Large out-of-band buffers are recorded by ``buffer_callback``.

    Given ``start_objects``, it also puts a placeholder in place of each object that ``multiprocessing``
    sends only to a starting process (see :mod:`mplaunch._wire.start_objects`), and collects the objects
    there; its type is judged once per pickle (one dict look-up per object), and, with ``probe``, by the
    object's own reduction where the type is unknown. With ``keep_shared`` too, a storage in torch's shared
    memory (the user's ``share_memory_()``) is such an object: it travels with the start by torch's own
    reduction, so the reader shares it with the writer instead of getting a copy."""

    inline_bytes = INLINE_BYTES

    def __init__(
        self,
        file: io.BytesIO,
        imports: WorkerImports | None = None,
        start_objects: at_start.StartObjects | None = None,
        probe: bool = False,
        keep_shared: bool = False,
    ) -> None:
        self._init_storages(start_objects, probe, keep_shared)
        self._imports = imports
        super().__init__(file, protocol=5, buffer_callback=self._keep_buffer)  # type: ignore[call-arg] # the pickler's

    def _init_storages(
        self, start_objects: at_start.StartObjects | None = None, probe: bool = False, keep_shared: bool = False
    ) -> None:
        self.keep_shared = keep_shared and start_objects is not None
        self._shared_seen: dict[int, int] = {}  # a shared storage -> its index among the start objects
        self.storages: list[torch.UntypedStorage] = []
        self.buffers: list[pickle.PickleBuffer] = []
        self._seen: dict[int, int] = {}
        self.start_objects = start_objects
        self._probe = probe
        self._kinds: dict[type, int] = {}

    def _keep_buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """``buffer_callback``: large contiguous buffers go out of band (return False), others in band."""
        view = buffer.raw()
        if view.nbytes < self.inline_bytes:
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
            return (_rebuild_storage, ("inline", index, dtype, bytes(_storage_bytes(untyped))))
        return (_rebuild_storage, ("file", index, dtype, nbytes))

    def _reduce_start_object(self, obj: object) -> Any:
        """An object that only a starting process may receive (collecting ``start_objects``), by index; else
        ``NotImplemented``. Its type is judged on first sight."""
        kind = self._kinds.get(type(obj))
        if kind is None:
            kind = self._kinds[type(obj)] = at_start.kind_of(type(obj))
            if kind == at_start.NEVER and self._probe and at_start.refused_outside_start(obj):
                kind = self._kinds[type(obj)] = at_start.ALWAYS
        if kind == at_start.NEVER or not at_start.is_start_object(obj, kind):
            return NotImplemented
        return (_start_object, (self.start_objects.add(obj),))  # type: ignore[union-attr]


class _NeedsValue(pickle.PicklingError):
    """A function or class that the reader cannot import by name: the object must be pickled by value."""


class _Pickler(_StorageWriter, pickle.Pickler):
    """Pickles by reference, like ``pickle``; storages are recorded, not copied. Given ``imports`` (what the
    reader can import), a function or class the reader cannot import raises :class:`_NeedsValue`."""

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
    obj: object,
    by_value: bool,
    imports: WorkerImports | None = None,
    start_objects: bool = False,
    keep_shared: bool = False,
) -> tuple[memoryview, _StorageWriter]:
    """Pickle ``obj``: by reference first (unless ``by_value``), by value with cloudpickle if that fails or if
    it holds a function or class that ``imports`` says the reader cannot import. Returns the pickle and the
    pickler, which holds the storages and out-of-band buffers it recorded, and with ``start_objects`` the
    objects that travel only with a starting process (found by type; if one of unknown type refuses, again
    by trying each object's reduction)."""
    try:
        found = at_start.StartObjects() if start_objects else None
        return _pickle_once(obj, by_value, imports, found, False, keep_shared)
    except RuntimeError as error:
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
) -> tuple[memoryview, _StorageWriter]:
    if not by_value:
        buffer = io.BytesIO()
        pickler: _StorageWriter = _Pickler(buffer, imports, found, probe, keep_shared)
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


class _InlineCloudPickler(_CloudPickler):
    inline_bytes = 1 << 62


def to_bytes(obj: object) -> bytes:
    """Pickle ``obj`` into one self-contained ``bytes`` object (every storage and buffer inline), to send it
    to another machine; by value where needed (cloudpickle)."""
    buffer = io.BytesIO()
    _InlineCloudPickler(buffer).dump(obj)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """Read an object written by :func:`to_bytes`."""
    return _Reader(-1, "private").load(data, [])


def pickle_error(
    obj: object, *, by_value: bool = False, imports: WorkerImports | None = None, start_objects: bool = False
) -> Exception | None:
    """Return why ``obj`` cannot be sent (the pickling exception), or ``None`` if it can; with
    ``start_objects``, objects that travel with a starting process are not counted (see :func:`dump`)."""
    try:
        _pickle(obj, by_value, imports, start_objects)
    except Exception as error:  # noqa: BLE001 - the error is the answer
        return error
    return None


def _write_at(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written : written + (1 << 30)], offset + written)


def _aligned(offset: int) -> int:
    return -(-offset // _PAGE) * _PAGE


def _layout(
    obj: object, by_value: bool, imports: WorkerImports | None, start_objects: bool, keep_shared: bool = False
) -> tuple[list[tuple[int, memoryview]], int, bytes, memoryview, list[Any]]:
    """Pickle ``obj``; return the data pieces (offset, bytes) at page-aligned offsets, where the data ends
    (page-aligned), the header (the buffers' extents and the storages' offsets), the pickle, and with
    ``start_objects`` the objects written as placeholders (see :func:`dump`)."""
    data, pickler = _pickle(obj, by_value, imports, start_objects, keep_shared)
    pieces: list[tuple[int, memoryview]] = []  # (offset in the data file, bytes)
    offsets: dict[int, int] = {}  # storage index -> offset
    end = 0
    for index, storage in enumerate(pickler.storages):
        if storage.nbytes() >= INLINE_BYTES:
            offsets[index] = end
            pieces.append((end, _storage_bytes(storage)))
            end = _aligned(end + storage.nbytes())
    extents: list[tuple[int, int]] = []
    for buffer in pickler.buffers:
        raw = buffer.raw()
        extents.append((end, raw.nbytes))
        pieces.append((end, raw))
        end = _aligned(end + raw.nbytes)
    table = pickle.dumps(offsets, protocol=5)
    header = b"".join(
        [_HEADER.pack(len(extents)), *(_EXTENT.pack(*extent) for extent in extents), _HEADER.pack(len(table)), table]
    )
    return pieces, end, header, data, [] if pickler.start_objects is None else pickler.start_objects.objects


def dump(
    obj: object,
    directory: str,
    name: str,
    *,
    by_value: bool = False,
    imports: WorkerImports | None = None,
    start_objects: bool = False,
    keep_shared: bool = False,
) -> list[Any]:
    """Write ``obj`` as ``directory/name.pkl``, plus ``name.bin`` holding its storages and buffers of
    64 KiB or more.

    The ``.pkl`` file appears last and atomically (written aside, then renamed), so a reader that sees it
    sees a complete object. Tensors on other devices are copied to the CPU first. With ``imports`` (what
    the reading workers can import by name), functions and classes they cannot import travel by value.

    Args:
        obj: what to write.
        directory: where to write it.
        name: its name there.
        by_value: pickle with cloudpickle from the start.
        imports: what the readers can import by name (``None``: pickle's and cloudpickle's own rules).
        start_objects: write a placeholder for each object that ``multiprocessing`` sends only to a starting
            process (queues, locks, ``Pipe`` ends...: :mod:`mplaunch._wire.start_objects`) and return the
            objects; the reader passes the same objects, received with its start, to :func:`load`.
        keep_shared: with ``start_objects``, storages in torch's shared memory (``share_memory_()``) are start
            objects too, so the readers share them with the writer.

    Returns:
        The objects written as placeholders, in placeholder order (empty without ``start_objects``).

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled even by value.
        RuntimeError: ``obj`` holds an object that travels only with a starting process, and not
            ``start_objects``.
        OSError: the directory is missing or full.
    """
    pieces, _, header, data, objects = _layout(obj, by_value, imports, start_objects, keep_shared)
    if pieces:
        fd = os.open(os.path.join(directory, f"{name}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for offset, piece in pieces:
                _write_at(fd, piece, offset)
        finally:
            os.close(fd)
    staging = os.path.join(directory, f".{name}.pkl")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_at(fd, header, 0)
        _write_at(fd, data, len(header))
    finally:
        os.close(fd)
    os.replace(staging, os.path.join(directory, f"{name}.pkl"))
    return objects


def dump_fd(
    obj: object,
    fd: int,
    *,
    by_value: bool = False,
    imports: WorkerImports | None = None,
    start_objects: bool = False,
    keep_shared: bool = False,
) -> list[Any]:
    """Write ``obj`` into the memory file ``fd`` (see :func:`mplaunch._wire.fds.memory_file`), replacing what
    it held: the storages and buffers of 64 KiB or more, then the header and the pickle, then the trailer,
    last, so a reader that finds the trailer finds a complete object. Arguments and the return value as for
    :func:`dump`.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled even by value.
        RuntimeError: as for :func:`dump`.
        OSError: no memory for it.
    """
    pieces, end, header, data, objects = _layout(obj, by_value, imports, start_objects, keep_shared)
    os.ftruncate(fd, 0)
    for offset, piece in pieces:
        _write_at(fd, piece, offset)
    _write_at(fd, header, end)
    _write_at(fd, data, end + len(header))
    _write_at(fd, _TRAILER.pack(end, _MAGIC), end + len(header) + len(data))
    return objects


def remove(directory: str, name: str) -> None:
    """Remove whatever :func:`dump` wrote (or began to write) for ``name``."""
    for entry in (f"{name}.pkl", f"{name}.bin", f".{name}.pkl"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, entry))


class _Reader:
    """Maps the storages of one object being unpickled; :func:`_rebuild_storage` finds it in ``_reading``."""

    def __init__(
        self, fd: int, how: str, offsets: dict[int, int] | None = None, start_objects: Sequence[Any] = ()
    ) -> None:
        self._fd = fd
        self._how = how  # "private", "shared" (mapped) or "copy" (read)
        self._offsets = offsets or {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.start_objects = start_objects

    def storage(self, kind: str, index: int, dtype: torch.dtype | None, data: Any) -> Any:
        if kind == "inline":
            storage = torch.UntypedStorage(len(data))
            if data:
                _storage_bytes(storage)[:] = data
            self._storages[index] = storage
        elif kind == "file":
            array = self._piece(self._offsets[index], data)
            self._storages[index] = torch.frombuffer(array, dtype=torch.uint8).untyped_storage()
        elif kind == "shared":  # the user's shared memory, received with this process's start
            return torch.storage.TypedStorage(
                wrap_storage=self.start_objects[index], dtype=dtype or torch.uint8, _internal=True
            )
        # An untyped storage comes back wrapped as bytes, as torch.load returns it (tensors of the newer
        # dtypes, e.g. float8 or uint16, pickle their untyped storage and expect this on rebuild).
        return torch.storage.TypedStorage(
            wrap_storage=self._storages[index], dtype=dtype or torch.uint8, _internal=True
        )

    def _piece(self, offset: int, nbytes: int) -> Any:
        if self._how == "copy":
            return read_file(self._fd, offset, nbytes)
        return map_file(self._fd, offset, nbytes, private=self._how == "private")

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
    """Unpickling side of :class:`_StorageWriter`: the storage, from the reader now unpickling."""
    reader: _Reader | None = getattr(_reading, "reader", None)
    if reader is None:
        raise pickle.UnpicklingError("mplaunch storages can only be read with mplaunch._transport.load")
    return reader.storage(kind, index, dtype, data)


def _read(view: mmap.mmap, start: int, fd: int, how: str, start_objects: Sequence[Any] = ()) -> Any:
    """Unpickle the object whose header begins at ``start`` of ``view``, its data in ``fd``."""
    (count,) = _HEADER.unpack_from(view, start)
    extents = [_EXTENT.unpack_from(view, start + _HEADER.size + i * _EXTENT.size) for i in range(count)]
    start += _HEADER.size + count * _EXTENT.size
    (table_size,) = _HEADER.unpack_from(view, start)
    start += _HEADER.size
    offsets = pickle.loads(view[start : start + table_size])
    reader = _Reader(fd, how, offsets, start_objects)
    with memoryview(view) as pickled, pickled[start + table_size :] as data:
        # released here, not by the traceback: an error while unpickling must not become
        # "BufferError: cannot close exported pointers exist" when the file's mapping closes
        return reader.load(data, reader.buffers(extents))


def _start_object(index: int) -> Any:
    """Unpickling side of a start object's placeholder: the object the reader received with its start."""
    reader: _Reader | None = getattr(_reading, "reader", None)
    if reader is None or index >= len(reader.start_objects):
        raise pickle.UnpicklingError(
            "this pickle refers to an object sent with the process start (a queue, lock, Pipe end...) "
            "that the reader was not given"
        )
    return reader.start_objects[index]


def load(
    directory: str,
    name: str,
    *,
    private: bool,
    remove: bool,
    missing_ok: bool = False,
    start_objects: Sequence[Any] = (),
) -> Any:
    """Read the object ``name`` written by :func:`dump`.

    Args:
        directory: where it was written.
        name: its name.
        private: map storages and buffers copy-on-write (each reader gets its own copy of what it changes,
            the rest stays backed by the file) instead of reading them into this process's own memory.
        remove: unlink its files once read (mapped data lives on in the mappings until they are freed).
        missing_ok: return ``None`` when no complete object ``name`` was written, instead of raising.
        start_objects: what :func:`dump` returned, received with this process's start: the objects its
            placeholders stand for.

    Raises:
        FileNotFoundError: nothing complete was written as ``name`` (and not ``missing_ok``).
        OSError: no memory for the data.
        Exception: whatever unpickling raises (a class missing in this process, a corrupt file).
    """
    path, data_path = os.path.join(directory, f"{name}.pkl"), os.path.join(directory, f"{name}.bin")
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        if missing_ok:  # (a data file that a stopped writer left is removed with the directory)
            return None
        raise
    try:
        with file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            try:
                fd = os.open(data_path, os.O_RDWR if private else os.O_RDONLY)
            except FileNotFoundError:
                fd = -1  # everything is in the pickle
            try:
                return _read(view, 0, fd, "private" if private else "copy", start_objects)
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        if remove:
            for leftover in (path, data_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def load_fd(fd: int, *, private: bool, missing_ok: bool = False, start_objects: Sequence[Any] = ()) -> Any:
    """Read the object that :func:`dump_fd` wrote into the memory file ``fd`` (which stays open).

    Args:
        fd: the memory file.
        private: map storages and buffers copy-on-write (a payload, which every worker maps) instead of
            shared; a shared read is a result: the pickle's pages are cut off the file once read, and the
            data lives in this process's mappings, whose changes a process forked from this one would share
            (see :func:`mplaunch._wire.mappings.make_private`).
        missing_ok: return ``None`` when the file holds no complete object, instead of raising.
        start_objects: as for :func:`load`.

    Raises:
        FileNotFoundError: the file holds no complete object (and not ``missing_ok``).
        OSError: no memory for the mappings.
        Exception: whatever unpickling raises (a class missing in this process).
    """
    size = os.fstat(fd).st_size
    trailer = os.pread(fd, _TRAILER.size, size - _TRAILER.size) if size >= _TRAILER.size else b""
    start, magic = _TRAILER.unpack(trailer) if len(trailer) == _TRAILER.size else (0, 0)
    if magic != _MAGIC or start >= size:
        if missing_ok:
            return None
        raise FileNotFoundError("the memory file holds no complete object")
    with mmap.mmap(fd, size - start, offset=start, access=mmap.ACCESS_READ) as view:
        value = _read(view, 0, fd, "private" if private else "shared", start_objects)
    if not private:
        os.ftruncate(fd, start)  # the header and pickle: only the data is kept
    return value
