"""Keeping this process's environment as it was found; a forked child's made before the fork."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """Undo on exit (also on an exception) the changes made to ``os.environ`` inside the block."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            replace_environ(saved)


def replace_environ(wanted: Mapping[str, str]) -> None:
    """Make ``os.environ`` exactly ``wanted``, touching only what differs (``clear()`` would be quadratic)."""
    environ = os.environ
    for name in [name for name in environ if name not in wanted]:
        del environ[name]
    for name, value in wanted.items():
        if environ.get(name) != value:
            environ[name] = value


def c_getenv(name: str) -> str | None:
    """Return ``name``'s value in the C library's table (``os.putenv`` changes it alone), as C code reads it."""
    getenv = _c_getenv()
    if getenv is None:
        return os.environ.get(name)
    value = getenv(os.fsencode(name))
    return None if value is None else os.fsdecode(value)


@functools.lru_cache(maxsize=1)
def _c_getenv() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        getenv = ctypes.CDLL(None).getenv
    except (OSError, AttributeError):
        return None
    getenv.argtypes, getenv.restype = [ctypes.c_char_p], ctypes.c_char_p
    return getenv


@functools.lru_cache(maxsize=1)
def _c_environ() -> ctypes.c_void_p | None:
    """Return the C library's ``environ`` pointer on Linux (glibc and musl accept a new table there), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.c_void_p.in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, AttributeError):
        return None


class ForkEnviron:
    """A child's whole environment, made before the fork, installed with two assignments (``setenv`` copies pages)."""

    def __init__(self, table: Any, strings: tuple[Any, ...], data: dict[bytes, bytes]) -> None:
        self._table = table  # a NULL-terminated ctypes array of char* (as addresses)
        self._strings = strings  # what holds the strings it points to that the C library's table does not
        self._data = data

    def install(self) -> None:
        """Make this the forked child's environment, for C code and ``os.environ`` alike."""
        c_environ = _c_environ()
        assert c_environ is not None  # (fork_environs made none without it)
        c_environ.value = ctypes.addressof(self._table)
        inherited = os.environ._data  # type: ignore[attr-defined]
        os.environ._data = self._data  # type: ignore[attr-defined]
        environb = getattr(os, "environb", None)  # os.environb is a view of the same mapping
        if environb is not None and getattr(environb, "_data", None) is inherited:
            environb._data = self._data


def fork_environs(
    shared: Mapping[str, str | None], own: Sequence[Mapping[str, str | None]]
) -> list[ForkEnviron] | None:
    """Return a :class:`ForkEnviron` per item of ``own``: the C table's environment with ``shared``'s changes, then
    the item's (``None`` removes); ``None`` where it cannot be. No other thread may change the environment meanwhile."""
    c_environ = _c_environ()
    data = getattr(os.environ, "_data", None)
    if c_environ is None or not c_environ.value or type(os.environ) is not os._Environ or type(data) is not dict:
        return None
    encode_key: Callable[[str], bytes] = os.environ.encodekey  # type: ignore[assignment]
    encode_value: Callable[[str], bytes] = os.environ.encodevalue  # type: ignore[assignment]

    def encoded(some: Mapping[str, str | None]) -> dict[bytes, bytes | None]:
        return {encode_key(name): None if value is None else encode_value(value) for name, value in some.items()}

    owned = set().union(*own)  # shared changes that a child changes again are that child's own
    common = encoded({name: value for name, value in shared.items() if name not in owned})
    overridden = {name: value for name, value in shared.items() if name in owned}
    specific = [encoded({**overridden, **mine}) for mine in own]
    found = _c_entries(c_environ.value)
    base = dict(data)
    _apply(base, common)
    shared_strings, shared_addresses = _c_strings(common)
    made = []
    for mine in specific:
        names = common.keys() | mine.keys()
        rank_strings, rank_addresses = _c_strings(mine)
        table = [address for name, address in found if name not in names] + shared_addresses + rank_addresses
        rank_data = dict(base)
        _apply(rank_data, mine)
        c_table = ctypes.create_string_buffer(struct.pack(f"{len(table) + 1}P", *table, 0))
        made.append(ForkEnviron(c_table, (shared_strings, rank_strings), rank_data))
    return made


# The C table as last read: its address, its pointers (bytes), and (name, address) per entry.
_read: tuple[int, bytes, list[tuple[bytes, int]]] = (0, b"", [])


def _c_entries(address: int) -> list[tuple[bytes, int]]:
    """Return (name, address) of each entry of the C table, read again only when its pointers changed."""
    global _read
    last_address, last_pointers, last_entries = _read
    if address == last_address and ctypes.string_at(address, len(last_pointers)) == last_pointers:
        return last_entries  # (the table's memory holds at least as many pointers: it never shrinks)
    strings = ctypes.cast(address, ctypes.POINTER(ctypes.c_char_p))
    entries: list[bytes] = []
    while (entry := strings[len(entries)]) is not None:
        entries.append(entry)
    pointers = ctypes.string_at(address, (len(entries) + 1) * _POINTER)
    addresses = struct.unpack(f"{len(entries) + 1}P", pointers)
    _read = (address, pointers, [(entry.partition(b"=")[0], addresses[i]) for i, entry in enumerate(entries)])
    return _read[2]


_POINTER = struct.calcsize("P")


def _apply(data: dict[bytes, bytes], changes: Mapping[bytes, bytes | None]) -> None:
    for name, value in changes.items():
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value


def _c_strings(changes: Mapping[bytes, bytes | None]) -> tuple[Any, list[int]]:
    """Return a ctypes array holding the ``NAME=value`` entries ``changes`` sets, and their addresses."""
    entries = [name + b"=" + value for name, value in changes.items() if value is not None]
    holder = (ctypes.c_char_p * len(entries))(*entries)
    return holder, list(struct.unpack(f"{len(entries)}P", ctypes.string_at(holder, len(entries) * _POINTER)))
