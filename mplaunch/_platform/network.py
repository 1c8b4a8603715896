"""This process's network: the interface that reaches another host, and its own connections to a port."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import struct


def interface_towards(host: str) -> str | None:
    """Return the interface whose IPv4 address the kernel picks to reach ``host``, else ``None``."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # sends nothing: the kernel picks the route and the source
        source = socket.inet_aton(probe.getsockname()[0])
        for _, name in socket.if_nameindex():  # 0x8915: SIOCGIFADDR, an interface's first IPv4 address
            with contextlib.suppress(OSError):
                if fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()))[20:24] == source:
                    return name
    return None


def shut_connections(port: int) -> None:
    """Shut down this process's TCP connections to remote ``port``: a call blocked on one fails at once."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                with socket.socket(fileno=os.dup(fd)) as connection:
                    if connection.type == socket.SOCK_STREAM and connection.getpeername()[1:2] == (port,):
                        connection.shutdown(socket.SHUT_RDWR)
