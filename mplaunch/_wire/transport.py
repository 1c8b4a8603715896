"""Moving Python objects with tensors between the parent and its workers through shared memory.

An object is pickled once (protocol 5). The bytes of every tensor storage of 64 KiB or more, and every
out-of-band buffer of that size (NumPy arrays, :class:`pickle.PickleBuffer`), are written at page-aligned
offsets apart from the pickle, which refers to them by offset. They go to one of two places:

* an anonymous memory file (``memfd_create``, see :func:`mplaunch._wire.inherited.memory_file`) that the parent
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
import mmap
import os
import pickle
import struct
from collections.abc import Sequence
from typing import Any

from mplaunch._wire.importable import WorkerImports
from mplaunch._wire.pickling import INLINE_BYTES, Reader, pickle_object, storage_bytes

_PAGE = mmap.PAGESIZE
_HEADER = struct.Struct("<Q")  # number of out-of-band buffers
_EXTENT = struct.Struct("<QQ")  # offset, size of one out-of-band buffer in the data file
_TRAILER = struct.Struct("<QQ")  # where the pickle starts in a memory file, _MAGIC (or _MAGIC_PLAIN)
_MAGIC = 0x6D706C61756E6368  # "mplaunch": written last, so a memory file that ends with it is complete
_MAGIC_PLAIN = _MAGIC + 1  # the same, after a standard pickle alone (``plain``): pickle.loads reads it
_PLAIN_HEADER = _HEADER.pack(0) + _HEADER.pack(len(_EMPTY := pickle.dumps({}, protocol=5))) + _EMPTY  # no data


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
    data, pickler = pickle_object(obj, by_value, imports, start_objects, keep_shared)
    pieces: list[tuple[int, memoryview]] = []  # (offset in the data file, bytes)
    offsets: dict[int, int] = {}  # storage index -> offset
    end = 0
    for index, storage in enumerate(pickler.storages):
        if storage.nbytes() >= INLINE_BYTES:
            offsets[index] = end
            pieces.append((end, storage_bytes(storage)))
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
    plain: bool = False,
) -> list[Any]:
    """Write ``obj`` into the memory file ``fd`` (see :func:`mplaunch._wire.inherited.memory_file`), replacing what
    it held: the storages and buffers of 64 KiB or more, then the header and the pickle, then the trailer,
    last, so a reader that finds the trailer finds a complete object. Arguments and the return value as for
    :func:`dump`; ``plain``: the caller knows that ``obj`` holds no storage, buffer, function or class of its
    own, only importable records of built-in scalars (a rank's ``None``), so the standard pickler writes it.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled even by value.
        RuntimeError: as for :func:`dump`.
        OSError: no memory for it.
    """
    pieces: list[tuple[int, memoryview]] = []
    objects: list[Any] = []
    if plain:
        end, header, data = 0, _PLAIN_HEADER, memoryview(pickle.dumps(obj, protocol=5))
    else:
        pieces, end, header, data, objects = _layout(obj, by_value, imports, start_objects, keep_shared)
    os.ftruncate(fd, 0)
    for offset, piece in pieces:
        _write_at(fd, piece, offset)
    trailer = _TRAILER.pack(end, _MAGIC_PLAIN if plain else _MAGIC)
    if len(data) < INLINE_BYTES:  # one write: the pickle is small enough to copy
        _write_at(fd, b"".join((header, data, trailer)), end)
    else:
        _write_at(fd, header, end)
        _write_at(fd, data, end + len(header))
        _write_at(fd, trailer, end + len(header) + len(data))
    return objects


def remove(directory: str, name: str) -> None:
    """Remove whatever :func:`dump` wrote (or began to write) for ``name``."""
    for entry in (f"{name}.pkl", f"{name}.bin", f".{name}.pkl"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, entry))


def _read(view: mmap.mmap | bytes, start: int, fd: int, how: str, start_objects: Sequence[Any] = ()) -> Any:
    """Unpickle the object whose header begins at ``start`` of ``view``, its data in ``fd``."""
    (count,) = _HEADER.unpack_from(view, start)
    extents = [_EXTENT.unpack_from(view, start + _HEADER.size + i * _EXTENT.size) for i in range(count)]
    start += _HEADER.size + count * _EXTENT.size
    (table_size,) = _HEADER.unpack_from(view, start)
    start += _HEADER.size
    offsets = pickle.loads(view[start : start + table_size])
    reader = Reader(fd, how, offsets, start_objects)
    with memoryview(view) as pickled, pickled[start + table_size :] as data:
        # released here, not by the traceback: an error while unpickling must not become
        # "BufferError: cannot close exported pointers exist" when the file's mapping closes
        return reader.load(data, reader.buffers(extents))


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
    if magic not in (_MAGIC, _MAGIC_PLAIN) or start >= size:
        if missing_ok:
            return None
        raise FileNotFoundError("the memory file holds no complete object")
    how = "private" if private else "shared"
    if size - start <= INLINE_BYTES:  # a small pickle is read: a mapping would need one more descriptor
        read = os.pread(fd, size - start, start)
        if magic == _MAGIC_PLAIN:  # a rank's scalar or None: the standard unpickler alone reads it
            value = pickle.loads(memoryview(read)[len(_PLAIN_HEADER) : -_TRAILER.size])
        else:
            value = _read(read, 0, fd, how, start_objects)
    else:
        with mmap.mmap(fd, size - start, offset=start, access=mmap.ACCESS_READ) as view:
            value = _read(view, 0, fd, how, start_objects)
    if not private:
        os.ftruncate(fd, start)  # the header and pickle: only the data is kept
    return value
