"""Keeping this process's environment as it was found."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


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
