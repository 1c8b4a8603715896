"""Keeping this process's environment as it was found; a forked child's made before the fork."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """Put ``os.environ`` back as it was when the block began: variables set, changed or removed inside it
    (by mplaunch, torch elastic, or an imported library) are undone on the way out, also on an exception."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


@functools.lru_cache(maxsize=1)
def _c_environ() -> ctypes.c_void_p | None:
    """The C library's ``environ`` pointer (the table ``getenv`` and ``exec`` read), where ctypes reaches it
    (Linux: glibc and musl accept a new table there, and copy it on the next ``setenv``); else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.c_void_p.in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, AttributeError):
        return None


class ForkEnviron:
    """A child's whole environment, made in the parent before it forks: the child installs it with two
    assignments (the C library's ``environ`` table, and ``os.environ``'s mapping of encoded names and values).

    Setting the variables one by one in the child (``os.environ.update``) costs it about 0.4 ms for a rank's
    16: each ``setenv`` allocates from the heap it shares with the parent, and every page it writes there is
    copied (issue 26). Made with :func:`fork_environ`.
    """

    def __init__(self, table: Any, data: dict[bytes, bytes]) -> None:
        self._table = table  # a ctypes array of char*, NULL-terminated; it holds the strings it points to
        self._data = data

    def install(self) -> None:
        """In the forked child: make this its environment, for C code and for ``os.environ`` alike."""
        c_environ = _c_environ()
        assert c_environ is not None  # (fork_environ made none without it)
        c_environ.value = ctypes.addressof(self._table)
        os.environ._data = self._data  # type: ignore[attr-defined]


def fork_environ(changes: Mapping[str, str | None]) -> ForkEnviron | None:
    """This process's environment with ``changes`` (a value sets the variable, ``None`` removes it), for a
    child to install right after it is forked (:meth:`ForkEnviron.install`); ``None`` where that cannot be
    done (not Linux, no ctypes, an ``os.environ`` that is not Python's own mapping): the child then sets the
    variables itself.

    The C table starts from the C library's own (a variable set with ``os.putenv`` alone stays), as
    ``os.environ`` changes in the child would leave it. Call it with the GIL held and no other thread
    changing the environment (Python's own changes hold the GIL).
    """
    c_environ = _c_environ()
    data = getattr(os.environ, "_data", None)
    if c_environ is None or c_environ.value is None or type(os.environ) is not os._Environ or type(data) is not dict:
        return None
    encode_key: Callable[[str], bytes] = os.environ.encodekey  # type: ignore[assignment]
    encode_value: Callable[[str], bytes] = os.environ.encodevalue  # type: ignore[assignment]
    changed = {encode_key(name): None if value is None else encode_value(value) for name, value in changes.items()}
    table = ctypes.cast(c_environ.value, ctypes.POINTER(ctypes.c_char_p))
    entries: list[bytes] = []
    index = 0
    while (entry := table[index]) is not None:
        if entry.partition(b"=")[0] not in changed:
            entries.append(entry)
        index += 1
    data = dict(data)
    for name, value in changed.items():
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value
            entries.append(name + b"=" + value)
    return ForkEnviron((ctypes.c_char_p * (len(entries) + 1))(*entries, None), data)
