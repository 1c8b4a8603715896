"""Hosts of a multi-node test: Linux network namespaces on this machine, each with its own interfaces, address,
host name and hosts file, joined by a switch (a bridge in a namespace of its own). Nothing is added to the
machine's own network: every link lives inside the namespaces made here, on 10.213.0.0/24.

Each host has ``eth1`` on the hosts' network and a decoy ``eth0`` that reaches nothing (as a container bridge or a
second NIC would), and its own name on ``127.0.1.1`` in its hosts file by default, as Debian and Ubuntu write it.
A host's processes run with ``ip netns exec`` (which also mounts the host's ``/etc/netns/NAME/hosts`` over
``/etc/hosts``) in a UTS namespace of their own that carries the host name. Needs root (CI runs as root).

Every namespace name starts with :data:`PREFIX`, which holds this process's pid: :func:`remove_all` (run at the
end of the test session) removes what a test left, and :func:`remove_stale` what a killed session left.

Reproduce by hand (as root)::

    ip netns add sw && ip -n sw link add name br0 type bridge && ip -n sw link set br0 up
    ip netns add h1 && ip link add eth1 netns h1 type veth peer name p1 netns sw
    ip -n sw link set p1 master br0 up && ip -n h1 addr add 10.213.0.1/24 dev eth1 && ip -n h1 link set eth1 up
    (the same for h2 with 10.213.0.2; /etc/netns/h1/hosts names both hosts)
    ip netns exec h1 unshare --uts sh -c 'hostname host1; exec python train.py'
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The prefix of the namespaces of this process: at most 15 characters with a host's suffix.
PREFIX = f"mplt{os.getpid()}-"
NETWORK = "10.213.0"
#: Sets the host name, then runs the command: the first process in a new UTS namespace.
_NAMED = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _pids_in(namespace: str) -> list[int]:
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in found.stdout.split()]


def _remove(namespace: str) -> None:
    """Kill what still runs in ``namespace``, then remove it and its ``/etc/netns`` folder."""
    for pid in _pids_in(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def remove_all(prefix: str = PREFIX) -> None:
    """Remove every namespace whose name starts with ``prefix`` (this process's, by default)."""
    if shutil.which("ip") is None:
        return
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        for namespace in _namespaces():
            if namespace.startswith(prefix):
                _remove(namespace)


def remove_stale() -> None:
    """Remove the namespaces of test sessions whose process is gone (a session killed before its cleanup)."""
    if shutil.which("ip") is None:
        return
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        for namespace in _namespaces():
            pid = namespace.removeprefix("mplt").partition("-")[0]
            if namespace.startswith("mplt") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove(namespace)


def unavailable() -> str | None:
    """Why hosts cannot be made here, or ``None``."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` command is not installed"
    probe = f"{PREFIX}probe"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", "name", "probe0", "netns", probe, "type", "veth", "peer", "name", "probe1", "netns", probe)
    except subprocess.CalledProcessError as error:
        return f"network namespaces or veth pairs cannot be made here: {error.stderr.strip()}"
    finally:
        _remove(probe)
    return None


class Host:
    """One host: its name, namespace, address on the hosts' network, and the switch port its cable goes to."""

    def __init__(self, name: str, namespace: str, address: str, port: str, switch: str) -> None:
        self.name, self.namespace, self.address, self.port, self.switch = name, namespace, address, port, switch

    def popen(self, command: Sequence[str], env: Mapping[str, str], **options: object) -> subprocess.Popen[str]:
        """Start ``command`` on this host (text output piped): its pid is the command's own."""
        named = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", sys.executable, "-c", _NAMED, self.name]
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            [*named, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env), **options
        )

    def unplug(self) -> None:
        """Take this host's cable out: the switch's port goes down, and nothing reaches the host or leaves it."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def pids(self, within: float = 5.0) -> list[int]:
        """The processes still running on this host (a zombie has ended), once none is or ``within`` seconds
        passed: a process that ends with its parent takes a moment."""
        deadline = time.monotonic() + within
        while True:
            running = [pid for pid in _pids_in(self.namespace) if _state(pid) not in ("Z", "X", "")]
            if not running or time.monotonic() > deadline:
                return running
            time.sleep(0.1)


def _state(pid: int) -> str:
    """A process's state letter (``ps``'s STAT), ``""`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def make_hosts(tag: str, names: Sequence[str], *, own_name_on_loopback: bool = True) -> list[Host]:
    """Make one host per name (``tag``: a few characters, unique among this process's fixtures); remove what was
    made if one step fails. ``own_name_on_loopback``: each hosts file maps the host's own name to ``127.0.1.1``."""
    switch = f"{PREFIX}{tag}s"
    hosts = [Host(name, f"{PREFIX}{tag}{i}", f"{NETWORK}.{i + 1}", f"p{i}", switch) for i, name in enumerate(names)]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in hosts:
            ns = host.namespace
            _ip("netns", "add", ns)
            _ip("link", "add", "name", "eth1", "netns", ns, "type", "veth", "peer", "name", host.port, "netns", switch)
            _ip("-n", switch, "link", "set", host.port, "master", "br0", "up")
            _ip("-n", ns, "link", "add", "name", "eth0", "type", "veth", "peer", "name", "eth0peer")  # the decoy
            _ip("-n", ns, "addr", "add", f"10.214.0.{hosts.index(host) + 1}/24", "dev", "eth0")
            _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth1")
            for link in ("lo", "eth0", "eth0peer", "eth1"):
                _ip("-n", ns, "link", "set", link, "up")
            lines = ["127.0.0.1 localhost"]
            lines += [
                f"{'127.0.1.1' if other is host and own_name_on_loopback else other.address} {other.name}"
                for other in hosts
            ]
            folder = Path(f"/etc/netns/{ns}")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")
    except BaseException:
        remove(hosts)
        raise
    return hosts


def remove(hosts: Sequence[Host]) -> None:
    """Remove ``hosts`` and their switch, killing what still runs on them."""
    switches = {host.switch for host in hosts}
    for namespace in [host.namespace for host in hosts] + sorted(switches):
        _remove(namespace)
