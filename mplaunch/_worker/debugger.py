"""``post_mortem=True``: pdb at the failing frame of the first rank that raises, on the caller's terminal.

The rank opens the terminal itself (``/dev/tty``, its controlling terminal, which it shares with the parent)
and makes its own process group the terminal's foreground group while the debugger runs, so that it may
read the keyboard (a background group reading it would be stopped by SIGTTIN) and Ctrl-C reaches it; then it
gives the terminal back to the group that had it. The other ranks go on meanwhile: the launch sees the
failure only once this rank ends. One rank debugs at a time: the first to create a marker file in the launch
directory.
"""

from __future__ import annotations

import contextlib
import os
import pdb
import signal

from mplaunch._wire.records import WorkerSpec

_MARKER = "post-mortem"


def post_mortem(error: BaseException, spec: WorkerSpec, rank: int) -> None:
    """Open pdb at the frame that raised ``error``, on the terminal, if this rank is the first to fail and
    the launching process is in the terminal's foreground; return when the session ends (``c`` or ``q``)."""
    if not isinstance(error, Exception) or error.__traceback__ is None:
        return  # SystemExit, KeyboardInterrupt: not a bug to look at
    try:
        os.close(os.open(os.path.join(spec.directory, _MARKER), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return  # another rank is (or was) in the debugger
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # no controlling terminal
    try:
        _debug_on(fd, error, rank, os.getpgid(spec.parent_pid))
    finally:
        os.close(fd)


def _debug_on(fd: int, error: BaseException, rank: int, parent_group: int) -> None:
    """Run pdb on terminal ``fd`` as its foreground group, if ``parent_group`` has it now."""
    foreground = os.tcgetpgrp(fd)
    if foreground != parent_group:
        return  # the launch runs in the background: the keyboard is someone else's
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may then take the terminal
    try:
        os.tcsetpgrp(fd, os.getpgrp())
        try:
            with (
                open(fd, encoding="utf-8", errors="replace", closefd=False) as stdin,
                open(fd, "w", encoding="utf-8", buffering=1, closefd=False) as stdout,
            ):
                stdout.write(
                    f"\nmplaunch: rank {rank} raised {type(error).__name__}: {error}\n"
                    "Post-mortem debugger at the failing line; 'q' or 'c' ends it, and the launch goes on.\n"
                )
                debugger = pdb.Pdb(stdin=stdin, stdout=stdout)
                debugger.prompt = f"(Pdb rank {rank}) "
                debugger.reset()
                debugger.interaction(None, error.__traceback__)
        finally:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(fd, foreground)
    finally:
        signal.signal(signal.SIGTTOU, previous)
