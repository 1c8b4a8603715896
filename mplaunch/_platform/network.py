"""This process's network: the interface that reaches another host, and its own connections to a port."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's (first) IPv4 address


def interface_towards(host: str) -> str | None:
    """Return the name of the interface whose IPv4 address the kernel picks to reach ``host`` (a name or an
    address), else ``None``: no IPv4 address, no route, or an address that is no interface's first."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # sends nothing: the kernel picks the route and the source
        source = socket.inet_aton(probe.getsockname()[0])
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                if fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))[20:24] == source:
                    return name
    return None


def shut_connections(port: int) -> None:
    """Shut down this process's TCP connections to remote ``port`` (whoever holds them): a call blocked on one
    returns at once, and later calls on it fail at once."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[os.readlink(f"/proc/self/fd/{name}")] = int(name)
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for fields in map(str.split, list(lines)[1:]):  # 2: the remote address:port in hex, 9: the inode
                fd = fds.get(f"socket:[{fields[9]}]")
                if fd is not None and int(fields[2].rpartition(":")[2], 16) == port:
                    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
                        connection.shutdown(socket.SHUT_RDWR)
