"""libc ``mmap`` of the data that travels (no descriptor held; unmapped with its last tensor): *mapped*
copy-on-write (a write copies its page only) or *copied* (read, so a launch file's tmpfs space goes on unlink)."""

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
_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def _mmap(nbytes: int, flags: int, fd: int, offset: int) -> int:
    found = _libc.mmap(None, nbytes, _READ_WRITE, flags, fd, offset)
    if found is None or found == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
    return int(found)


def _array(address: int, nbytes: int) -> Any:
    """Wrap a mapping in a ctypes array that unmaps it when freed (with every tensor or view made from it)."""
    array = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(array, _libc.munmap, address, nbytes)
    return array


def map_file(fd: int, offset: int, nbytes: int) -> Any:
    """Map ``nbytes`` of ``fd`` at page-aligned ``offset``, copy-on-write: pages are the file's until written."""
    return _array(_mmap(nbytes, mmap.MAP_PRIVATE, fd, offset), nbytes)


def read_file(fd: int, offset: int, nbytes: int) -> Any:
    """Read ``nbytes`` of ``fd`` from ``offset`` into new anonymous memory (raises OSError if short)."""
    array = _array(_mmap(nbytes, _ANONYMOUS, -1, 0), nbytes)
    view = memoryview(array).cast("B")
    done = 0
    while done < nbytes:
        count = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        if count <= 0:
            raise OSError(f"the data file ended {nbytes - done} bytes early")
        done += count
    return array
