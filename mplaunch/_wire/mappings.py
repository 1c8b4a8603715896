"""Memory mappings of the data that travels between processes: ``mmap`` through libc, so that a mapping
holds no file descriptor and is unmapped when the last tensor or array using it is freed.

Three kinds: *private* (copy-on-write over a file or memfd: an argument each worker may change on its own),
*shared* (over a memfd that only this process holds once loaded: a result, which costs no copy), and
*copied* (anonymous memory filled from a file: a result read from a file in the launch directory, so that
the file's space on the tmpfs is free the moment it is unlinked). Shared mappings are tracked in
:data:`_shared`: a process forked from this one would share them, and :func:`make_private` turns one into a
private copy in place.
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

#: This process's live shared mappings (results), address -> bytes: a process forked from it shares them.
_shared: dict[int, int] = {}


def holds_shared_mappings() -> bool:
    """Whether this process holds a shared mapping made by :func:`map_file` (a result, or part of one, that
    the caller keeps): a process forked from this one would share it. mplaunch's own bookkeeping mappings
    (the heartbeat board, the preemption flag) are not counted: no argument lives there."""
    return bool(_shared)


def _mmap(address: int | None, nbytes: int, flags: int, fd: int, offset: int) -> int:
    found = _libc.mmap(address, nbytes, _READ_WRITE, flags, fd, offset)
    if found is None or found == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
    return int(found)


def _array(address: int, nbytes: int) -> Any:
    """A writable ctypes array over a mapping, which is unmapped when the array (and so every tensor or
    memoryview made from it) is freed."""
    array = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(array, _unmap, address, nbytes)
    return array


def map_file(fd: int, offset: int, nbytes: int, *, private: bool) -> Any:
    """Map ``nbytes`` of ``fd`` at ``offset`` (page-aligned), copy-on-write (``private``) or shared.

    Raises:
        OSError: the mapping failed (no memory, a descriptor that cannot be mapped).
    """
    address = _mmap(None, nbytes, mmap.MAP_PRIVATE if private else mmap.MAP_SHARED, fd, offset)
    if not private:
        _shared[address] = nbytes
    return _array(address, nbytes)


def read_file(fd: int, offset: int, nbytes: int) -> Any:
    """Read ``nbytes`` of ``fd`` from ``offset`` into new anonymous memory of this process (one copy).

    Raises:
        OSError: no memory, or the read failed or came up short.
    """
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
    """Whether ``address`` lies in a shared mapping that :func:`map_file` made (a result): unlike a private
    mapping, a process forked from this one would share its changes."""
    return _shared_mapping(address) is not None


def make_private(address: int) -> bool:
    """Turn the shared mapping that holds ``address`` (see :func:`in_shared_mapping`) into a private copy
    at the same address, so that every tensor and array in it, and every view of them, becomes this
    process's own at once; for a forked process, before its other threads touch that memory. Costs one copy
    of the mapping (two where ``mremap`` is missing). Returns False when ``address`` is in no such mapping.

    Raises:
        OSError: no memory for the copy.
    """
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
