"""Mappings of the data that travels between processes: libc ``mmap``, so a mapping holds no descriptor and
goes when the last tensor or array using it is freed. *Private* (copy-on-write: an argument), *shared* (a
result over a memfd only this process holds: no copy), or *copied* (read from a launch-directory file, so
its tmpfs space is freed on unlink). Shared ones are tracked in :data:`_shared`: a forked process would
share them, so :func:`make_private` can turn one private in place.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # the mmap module names it from Python 3.13; 0x10 on Linux and BSDs
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # <linux/mman.h>
_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_mremap = getattr(_libc, "mremap", None)
if _mremap is not None:
    _mremap.restype = ctypes.c_void_p
    _mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

_shared: dict[int, int] = {}


def holds_shared_mappings() -> bool:
    """Return whether this process holds a shared mapping made by :func:`map_file` (the board and flag do
    not count: no argument lives there)."""
    return bool(_shared)


def _mmap(address: int | None, nbytes: int, flags: int, fd: int, offset: int) -> int:
    found = _libc.mmap(address, nbytes, _READ_WRITE, flags, fd, offset)
    if found is None or found == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
    return int(found)


def _array(address: int, nbytes: int) -> Any:
    """Wrap a mapping in a ctypes array that unmaps it when freed (with every tensor or view made from it)."""
    array = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(array, _unmap, address, nbytes)
    return array


def map_file(fd: int, offset: int, nbytes: int, *, private: bool) -> Any:
    """Map ``nbytes`` of ``fd`` at page-aligned ``offset``, copy-on-write (``private``) or shared."""
    address = _mmap(None, nbytes, mmap.MAP_PRIVATE if private else mmap.MAP_SHARED, fd, offset)
    if not private:
        _shared[address] = nbytes
    return _array(address, nbytes)


def read_file(fd: int, offset: int, nbytes: int) -> Any:
    """Read ``nbytes`` of ``fd`` from ``offset`` into new anonymous memory (raises OSError if short)."""
    array = _array(_mmap(None, nbytes, _ANONYMOUS, -1, 0), nbytes)
    view = memoryview(array).cast("B")
    done = 0
    while done < nbytes:
        count = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        if count <= 0:
            raise OSError(f"the data file ended {nbytes - done} bytes early")
        done += count
    return array


def _unmap(address: int, nbytes: int) -> None:
    _shared.pop(address, None)
    _libc.munmap(address, nbytes)


def _shared_mapping(address: int) -> tuple[int, int] | None:
    for start, size in list(_shared.items()):
        if start <= address < start + size:
            return start, size
    return None


def in_shared_mapping(address: int) -> bool:
    """Return whether ``address`` lies in a shared mapping made by :func:`map_file`."""
    return _shared_mapping(address) is not None


def make_private(address: int) -> bool:
    """Turn the shared mapping holding ``address`` into a private copy in place (False if none), so every
    tensor and view in it is this process's own; a forked process does it before other threads touch it."""
    found = _shared_mapping(address)
    if found is None:
        return False
    start, size = found
    copy = _mmap(None, size, _ANONYMOUS, -1, 0)
    ctypes.memmove(copy, start, size)
    if _mremap is not None:  # Linux: move the copy's pages over the shared mapping, which goes away
        moved = _mremap(copy, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
        if moved == start:
            del _shared[start]
            return True
    try:
        _mmap(start, size, _ANONYMOUS | _MAP_FIXED, -1, 0)
    except OSError:
        _libc.munmap(copy, size)
        raise
    ctypes.memmove(start, copy, size)
    _libc.munmap(copy, size)
    del _shared[start]
    return True
