"""The wait status of a process someone else reaped (a caller's SIGCHLD handler looping ``os.waitpid(-1)``),
which the kernel keeps for pidfd holders: Linux 6.15+ ``ioctl(PIDFD_GET_INFO)`` with ``PIDFD_INFO_EXIT``
(``include/uapi/linux/pidfd.h``). Elsewhere ``None``: unknown."""

from __future__ import annotations

import struct
import sys

_INFO_SIZE = 64  # PIDFD_INFO_SIZE_VER0: struct pidfd_info up to exit_code and two more 32-bit fields
_INFO_EXIT = 1 << 3  # PIDFD_INFO_EXIT
_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, struct pidfd_info)
_EXIT_CODE_OFFSET = 8 + 8 + 11 * 4  # after mask, cgroupid and eleven 32-bit ids (pid ... fsgid)


def reaped_status(pidfd: int) -> int | None:
    """Return the ``os.wait4`` status of the reaped process of ``pidfd`` (opened before the reap), else ``None``."""
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
