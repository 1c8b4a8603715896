"""The caller's terminal, given back as it was found when a launch ends by stopping its ranks.

A rank shares the caller's terminal (it is in the caller's foreground job). One that is stopped while it has
the terminal in a mode of its own leaves that mode behind: pdb's line editor at a prompt (no echo, no line
editing), or ``tty.setraw``. A program that exits normally after that leaves the user's shell so, until
``stty sane``.
"""

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
    """When standard input is a terminal, note its settings (``termios``) before the launch; when the launch
    ends with an exception (a failure, a stop, a timeout, Ctrl-C) and the settings changed, put them back. A
    launch that returns leaves them as its ranks left them, as any program that returns does. Nothing is
    set while this process is a background job of the terminal (setting them would stop it, SIGTTOU)."""
    saved = _settings()
    if saved is None:
        yield
        return
    try:
        yield
    except BaseException:
        _restore(saved)
        raise


def _settings() -> list[Any] | None:
    """The terminal settings of standard input, or ``None`` when it is no terminal."""
    if termios is None:
        return None
    try:
        return termios.tcgetattr(0) if os.isatty(0) else None
    except (OSError, termios.error):
        return None


def _restore(saved: list[Any]) -> None:
    """Put ``saved`` back on standard input's terminal if it changed and this process is in the foreground."""
    with contextlib.suppress(OSError, termios.error):
        if os.tcgetpgrp(0) == os.getpgrp() and termios.tcgetattr(0) != saved:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
