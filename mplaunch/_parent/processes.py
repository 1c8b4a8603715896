"""What holds in the parent while it starts workers: a ``__main__`` that multiprocessing can describe to a
spawned child, and one string-hashing seed for spawned workers."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

from mplaunch._platform.environ import environ_kept


@contextlib.contextmanager
def main_prepared() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that is no real file (``python -`` sets ``<stdin>``): multiprocessing's
    spawn would try to run it in the child and fail before our code runs. A ``__main__`` without
    ``__spec__`` (``python -m pdb`` clears its namespace for the script) gets ``None``, as a script has:
    multiprocessing reads it."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    path = getattr(main, "__file__", None)
    hide = path is not None and not os.path.isfile(path)
    add_spec = "__spec__" not in vars(main)
    if hide:
        del main.__file__
    if add_spec:
        main.__spec__ = None
    try:
        yield
    finally:
        if hide:
            main.__file__ = path
        if add_spec:
            vars(main).pop("__spec__", None)


@functools.lru_cache(maxsize=1)
def _hash_seed() -> str:
    """This process's seed for the string hashing of its spawn workers, drawn once."""
    return str(int.from_bytes(os.urandom(4), "little") or 1)


@contextlib.contextmanager
def spawn_hash_seed(start_method: str) -> Iterator[None]:
    """Give spawn workers one ``PYTHONHASHSEED`` (unless the user set one), so that every rank hashes strings
    alike, as forked ranks (the parent's hashing) and forkserver ranks (the server's) do.

    The seed must be in the environment a spawned interpreter starts with, and multiprocessing execs it with
    this process's environment: it is set only while the workers start, with SIGINT and SIGTERM blocked (so
    no handler of ours runs in between), and removed at once. The same seed serves every launch of this
    process, so ranks of successive launches agree too.
    """
    if start_method != "spawn" or os.environ.get("PYTHONHASHSEED") not in (None, "", "random"):
        yield
        return
    with environ_kept():
        os.environ["PYTHONHASHSEED"] = _hash_seed()
        yield
