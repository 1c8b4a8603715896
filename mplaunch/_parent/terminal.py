"""The caller's terminal, given back as it was found when a launch ends by stopping its ranks: a rank stopped
while it has the shared terminal in a mode of its own (pdb's prompt, ``tty.setraw``) leaves that mode behind,
until ``stty sane``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

try:
    import termios
except ImportError:  # not a POSIX system
    termios = None  # type: ignore[assignment]


@contextlib.contextmanager
def terminal_kept() -> Iterator[None]:
    """Put standard input's terminal settings back when the launch raises (one that returns leaves them)."""
    saved = _settings()
    try:
        yield
    except BaseException:
        if saved is not None:
            _restore(saved)
        raise


def _settings() -> list[Any] | None:
    """Return standard input's terminal settings, or ``None`` when it is no terminal."""
    if termios is None:
        return None
    try:
        return termios.tcgetattr(0) if os.isatty(0) else None
    except (OSError, termios.error):
        return None


def _restore(saved: list[Any]) -> None:
    """Put ``saved`` back if it changed and this process is in the foreground (else SIGTTOU would stop it)."""
    with contextlib.suppress(OSError, termios.error):
        if os.tcgetpgrp(0) == os.getpgrp() and termios.tcgetattr(0) != saved:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
