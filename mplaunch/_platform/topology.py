"""CPU and NUMA facts read from sysfs, and how to split the CPUs this process may use between ranks.

Pure: every function reads files under ``root`` (``"/"`` on a real machine, a fake tree in tests) and returns
plain values. The sets follow the kernel's own lists: ``/sys/devices/system/cpu/cpuN/topology/
thread_siblings_list`` (the hardware threads of one core), ``/sys/devices/system/node/nodeN/cpulist`` (the
CPUs of one NUMA node) and ``/sys/bus/pci/devices/<bus id>/numa_node`` (the node a PCI device, e.g. a GPU,
hangs off). DeepSpeed's ``--bind_cores_to_rank`` and torchrun's ``--numa-binding`` split CPUs the same way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

_NODE = re.compile(r"node(\d+)$")


def parse_cpulist(text: str) -> list[int]:
    """The CPUs of a kernel CPU list such as ``"0-3,8-11"`` or ``"0-7:2"`` (a stride), sorted.

    Raises:
        ValueError: ``text`` is not a CPU list.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        span, _, stride = part.partition(":")
        low, dash, high = span.partition("-")
        step = int(stride) if stride else 1
        cpus.update(range(int(low), int(high if dash else low) + 1, step))
    return sorted(cpus)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read()
    except (OSError, ValueError):
        return None


def core_groups(cpus: Iterable[int], root: str = "/") -> list[tuple[int, ...]]:
    """The allowed ``cpus`` grouped by physical core (hyperthread siblings together), ordered by their first CPU.

    A CPU whose siblings sysfs does not list forms a core of its own.
    """
    allowed = set(cpus)
    groups: dict[int, tuple[int, ...]] = {}
    for cpu in sorted(allowed):
        if any(cpu in group for group in groups.values()):
            continue
        text = _read(os.path.join(root, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
        try:
            siblings = parse_cpulist(text) if text else [cpu]
        except ValueError:
            siblings = [cpu]
        group = tuple(sorted((set(siblings) & allowed) | {cpu}))
        groups[group[0]] = group
    return [groups[first] for first in sorted(groups)]


def numa_nodes(root: str = "/") -> dict[int, list[int]]:
    """Each NUMA node's CPUs (nodes without CPUs left out); empty where sysfs has no node directory."""
    base = os.path.join(root, "sys/devices/system/node")
    try:
        entries = os.listdir(base)
    except OSError:
        return {}
    nodes: dict[int, list[int]] = {}
    for entry in entries:
        match = _NODE.match(entry)
        text = _read(os.path.join(base, entry, "cpulist")) if match else None
        if match and text:
            try:
                cpus = parse_cpulist(text)
            except ValueError:
                continue
            if cpus:
                nodes[int(match.group(1))] = cpus
    return dict(sorted(nodes.items()))


def pci_numa_node(bus_id: str, root: str = "/") -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (e.g. ``"0000:3b:00.0"``), or ``None`` where the kernel does
    not say (``-1``, or no such file)."""
    text = _read(os.path.join(root, "sys/bus/pci/devices", bus_id.lower(), "numa_node"))
    try:
        node = int(text) if text else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def split_cores(cpus: Iterable[int], nprocs: int, root: str = "/") -> list[tuple[int, ...]]:
    """Split the allowed ``cpus`` into ``nprocs`` disjoint, non-empty sets of whole cores, in order; the first
    ``cores % nprocs`` sets get one core more. With fewer cores than ``nprocs``, hardware threads are split
    between ranks instead.

    Raises:
        ValueError: fewer allowed CPUs than ``nprocs``.
    """
    allowed = sorted(set(cpus))
    if len(allowed) < nprocs:
        raise ValueError(f"{len(allowed)} CPU(s) for {nprocs} ranks")
    groups = core_groups(allowed, root)
    if len(groups) < nprocs:
        groups = [(cpu,) for cpu in allowed]
    share, extra = divmod(len(groups), nprocs)
    sets, start = [], 0
    for rank in range(nprocs):
        end = start + share + (rank < extra)
        sets.append(tuple(cpu for group in groups[start:end] for cpu in group))
        start = end
    return sets


def split_numa(
    cpus: Iterable[int], nprocs: int, root: str = "/", preferred: Sequence[int | None] = ()
) -> list[tuple[int | None, tuple[int, ...]]]:
    """Give each of ``nprocs`` ranks the allowed ``cpus`` of one NUMA node: ``(node, cpus)`` per rank.

    Rank ``r`` takes ``preferred[r]`` (e.g. the node of its GPU) where that node has allowed CPUs, else the
    nodes with allowed CPUs in turn (round-robin). Without NUMA information every rank gets all allowed CPUs
    and the node ``None``.
    """
    allowed = set(cpus)
    usable = {node: tuple(c for c in node_cpus if c in allowed) for node, node_cpus in numa_nodes(root).items()}
    usable = {node: node_cpus for node, node_cpus in usable.items() if node_cpus}
    if not usable:
        return [(None, tuple(sorted(allowed)))] * nprocs
    order = sorted(usable)
    placed: list[tuple[int | None, tuple[int, ...]]] = []
    turn = 0
    for rank in range(nprocs):
        wish = preferred[rank] if rank < len(preferred) else None
        if wish is not None and wish in usable:
            node = wish
        else:
            node = order[turn % len(order)]
            turn += 1
        placed.append((node, usable[node]))
    return placed
