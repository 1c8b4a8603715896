"""CPU and NUMA facts read from sysfs under ``root`` (a fake tree in tests), and splitting the usable CPUs
between ranks by core or NUMA node, as DeepSpeed's ``--bind_cores_to_rank`` and torchrun's ``--numa-binding`` do."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from mplaunch._platform.cgroup import _read

_NODE = re.compile(r"node(\d+)$")


def parse_cpulist(text: str) -> list[int]:
    """Return the sorted CPUs of a kernel CPU list such as ``"0-3,8-11"`` or ``"0-7:2"`` (ValueError if not one)."""
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


def core_groups(cpus: Iterable[int], root: str = "/") -> list[tuple[int, ...]]:
    """Group the allowed ``cpus`` by physical core (a CPU without listed siblings alone), by first CPU."""
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
    """Return each NUMA node's CPUs (nodes without CPUs left out; empty without sysfs nodes)."""
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
    """Return the NUMA node of the PCI device ``bus_id`` (``"0000:3b:00.0"``), or ``None`` if unknown."""
    text = _read(os.path.join(root, "sys/bus/pci/devices", bus_id.lower(), "numa_node"))
    try:
        node = int(text) if text else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def split_cores(cpus: Iterable[int], nprocs: int, root: str = "/") -> list[tuple[int, ...]]:
    """Split ``cpus`` into ``nprocs`` disjoint sets of whole cores (else threads); ValueError: fewer CPUs than ranks."""
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
    """Give each rank ``(node, cpus)``: its GPU's node (``preferred``) if usable, else nodes round-robin."""
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
