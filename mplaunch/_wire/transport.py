"""Objects with tensors through shared memory: large data page-aligned apart from the pickle, in an inherited memory
file (:func:`dump_fd`) or launch-directory files (:func:`dump`), mapped copy-on-write as ordinary CPU storages
(not ``is_shared()``). Nothing flows through a pipe, so no size can deadlock a join."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
from collections.abc import Iterable, Sequence
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


def _write_at(fd: int, pieces: Iterable[tuple[int, memoryview | bytes]]) -> None:
    """Write each ``(offset, data)`` of ``pieces`` into ``fd``."""
    for offset, data in pieces:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written : written + (1 << 30)], offset + written)


def _aligned(offset: int) -> int:
    return -(-offset // _PAGE) * _PAGE


def _layout(
    obj: object, by_value: bool, imports: WorkerImports | None, start_objects: bool, keep_shared: bool = False
) -> tuple[list[tuple[int, memoryview]], int, bytes, memoryview, list[Any]]:
    """Pickle ``obj``; return the data pieces (offset, bytes), their end, the header, the pickle, the start objects."""
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
    """Write ``obj`` as ``directory/name.bin`` and ``name.pkl`` (renamed last); return the start objects, for load."""
    pieces, _, header, data, objects = _layout(obj, by_value, imports, start_objects, keep_shared)
    if pieces:
        fd = os.open(os.path.join(directory, f"{name}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_at(fd, pieces)
        finally:
            os.close(fd)
    staging = os.path.join(directory, f".{name}.pkl")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_at(fd, [(0, header), (len(header), data)])
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
    """Write ``obj`` into the memory file ``fd``, trailer last (``plain``: a record of scalars, standard pickler)."""
    pieces: list[tuple[int, memoryview]] = []
    objects: list[Any] = []
    if plain:
        end, header, data = 0, _PLAIN_HEADER, memoryview(pickle.dumps(obj, protocol=5))
    else:
        pieces, end, header, data, objects = _layout(obj, by_value, imports, start_objects, keep_shared)
    os.ftruncate(fd, 0)
    _write_at(fd, pieces)
    trailer = _TRAILER.pack(end, _MAGIC_PLAIN if plain else _MAGIC)
    if len(data) < INLINE_BYTES:  # one write: the pickle is small enough to copy
        _write_at(fd, [(end, b"".join((header, data, trailer)))])
    else:
        _write_at(fd, [(end, header), (end + len(header), data), (end + len(header) + len(data), trailer)])
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
        # released here, not by a traceback: else an error becomes "BufferError: cannot close exported pointers"
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
    """Read the object ``name`` written by :func:`dump`, its data mapped copy-on-write (``private``) or read;
    FileNotFoundError when nothing complete is there, unless ``missing_ok``."""
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


def load_fd(fd: int, *, result: bool, missing_ok: bool = False, start_objects: Sequence[Any] = ()) -> Any:
    """Read what :func:`dump_fd` wrote into ``fd``, mapped copy-on-write; a ``result``'s header and pickle
    pages are then cut off the file (a payload's file is read by every worker); otherwise as :func:`load`."""
    size = os.fstat(fd).st_size
    trailer = os.pread(fd, _TRAILER.size, size - _TRAILER.size) if size >= _TRAILER.size else b""
    start, magic = _TRAILER.unpack(trailer) if len(trailer) == _TRAILER.size else (0, 0)
    if magic not in (_MAGIC, _MAGIC_PLAIN) or start >= size:
        if missing_ok:
            return None
        raise FileNotFoundError("the memory file holds no complete object")
    if size - start <= INLINE_BYTES:  # a small pickle is read: a mapping would need one more descriptor
        read = os.pread(fd, size - start, start)
        if magic == _MAGIC_PLAIN:  # a rank's scalar or None: the standard unpickler alone reads it
            value = pickle.loads(memoryview(read)[len(_PLAIN_HEADER) : -_TRAILER.size])
        else:
            value = _read(read, 0, fd, "private", start_objects)
    else:
        with mmap.mmap(fd, size - start, offset=start, access=mmap.ACCESS_READ) as view:
            value = _read(view, 0, fd, "private", start_objects)
    if result:
        os.ftruncate(fd, start)  # the header and pickle: only the data is kept
    return value
