"""CPU and NUMA topology from a fake sysfs tree, and how CPUs are split between ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from mplaunch._platform import topology


def _sysfs(root: Path, siblings: dict[int, str], nodes: dict[int, str], pci: dict[str, str] | None = None) -> str:
    for cpu, text in siblings.items():
        path = root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        path.parent.mkdir(parents=True)
        path.write_text(text + "\n")
    for node, text in nodes.items():
        path = root / f"sys/devices/system/node/node{node}/cpulist"
        path.parent.mkdir(parents=True)
        path.write_text(text + "\n")
    (root / "sys/devices/system/node/possible").parent.mkdir(parents=True, exist_ok=True)
    (root / "sys/devices/system/node/possible").write_text("0-1\n")  # not a node directory
    for bus, numa_node in (pci or {}).items():
        path = root / f"sys/bus/pci/devices/{bus}/numa_node"
        path.parent.mkdir(parents=True)
        path.write_text(numa_node + "\n")
    return str(root)


# 2 nodes x 2 cores x 2 threads: node 0 = cores {0,4} {1,5}, node 1 = cores {2,6} {3,7} (Linux numbers the
# second thread of every core after all first threads)
SIBLINGS = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}
NODES = {0: "0-1,4-5", 1: "2-3,6-7"}


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,8-9\n", [0, 1, 8, 9]), ("0-7:2", [0, 2, 4, 6]), ("", [])],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert topology.parse_cpulist(text) == cpus


def test_core_groups_keep_siblings_together_within_the_mask(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, SIBLINGS, NODES)
    assert topology.core_groups(range(8), root) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert topology.core_groups([0, 1, 4], root) == [(0, 4), (1,)]  # 5 is not allowed
    assert topology.core_groups([9], root) == [(9,)]  # no sysfs entry: a core of its own


def test_split_cores_gives_disjoint_whole_cores(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, SIBLINGS, NODES)
    assert topology.split_cores(range(8), 2, root) == [(0, 4, 1, 5), (2, 6, 3, 7)]
    assert topology.split_cores(range(8), 3, root) == [(0, 4, 1, 5), (2, 6), (3, 7)]
    # more ranks than cores: hardware threads are split
    assert topology.split_cores(range(8), 8, root) == [(c,) for c in range(8)]
    with pytest.raises(ValueError, match="8 CPU"):
        topology.split_cores(range(8), 9, root)


def test_numa_nodes_and_split(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, SIBLINGS, NODES, {"0000:3b:00.0": "1", "0000:af:00.0": "-1"})
    assert topology.numa_nodes(root) == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert topology.split_numa(range(8), 3, root) == [(0, (0, 1, 4, 5)), (1, (2, 3, 6, 7)), (0, (0, 1, 4, 5))]
    # within the mask; a node with no allowed CPU is skipped
    assert topology.split_numa([0, 1], 2, root) == [(0, (0, 1)), (0, (0, 1))]
    # the GPU's node first, where there is one
    assert topology.pci_numa_node("0000:3B:00.0", root) == 1
    assert topology.pci_numa_node("0000:af:00.0", root) is None
    assert topology.pci_numa_node("0000:00:00.0", root) is None
    assert topology.split_numa(range(8), 2, root, preferred=[1, None]) == [(1, (2, 3, 6, 7)), (0, (0, 1, 4, 5))]


def test_no_numa_information_gives_every_rank_the_mask(tmp_path: Path) -> None:
    assert topology.numa_nodes(str(tmp_path)) == {}
    assert topology.split_numa([0, 1], 2, str(tmp_path)) == [(None, (0, 1)), (None, (0, 1))]
