"""What a pidfd can still say of a process that someone else reaped: its wait status (Linux 6.15+,
``ioctl(PIDFD_GET_INFO)`` with ``PIDFD_INFO_EXIT``; see ``include/uapi/linux/pidfd.h``).

A caller's SIGCHLD handler that reaps every child (``os.waitpid(-1, os.WNOHANG)`` in a loop, a common server
pattern) takes a worker's exit status before the launch can read it; the kernel keeps it for whoever holds a
pidfd of the process. Elsewhere (older kernels, other systems) the answer is ``None``: unknown.
"""

from __future__ import annotations

import struct
import sys

_INFO_SIZE = 64  # PIDFD_INFO_SIZE_VER0: struct pidfd_info up to exit_code and two more 32-bit fields
_INFO_EXIT = 1 << 3  # PIDFD_INFO_EXIT
_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, struct pidfd_info)
_EXIT_CODE_OFFSET = 8 + 8 + 11 * 4  # after mask, cgroupid and eleven 32-bit ids (pid ... fsgid)


def reaped_status(pidfd: int) -> int | None:
    """The wait status (as ``os.wait4`` gives it) of the ended process that ``pidfd`` refers to, once someone
    has reaped it, or ``None``: not yet reaped, or this kernel (before Linux 6.15) or system cannot say.

    Args:
        pidfd: a pidfd of the process (``os.pidfd_open``), opened before it was reaped.

    Returns:
        The wait status (``os.waitstatus_to_exitcode`` turns it into an exit code), or ``None``. Never raises.
    """
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    info = bytearray(_INFO_SIZE)
    struct.pack_into("=Q", info, 0, _INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _GET_INFO, info, True)
    except (OSError, ValueError, OverflowError):
        return None
    (mask,) = struct.unpack_from("=Q", info, 0)
    if not mask & _INFO_EXIT:
        return None
    (status,) = struct.unpack_from("=i", info, _EXIT_CODE_OFFSET)
    return int(status)
