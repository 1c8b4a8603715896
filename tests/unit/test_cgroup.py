"""The cgroup CPU limit, over fake cgroup trees (v1, v2, nested, no limit) and one real cgroup where allowed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mplaunch._parent import policy
from mplaunch._platform import cpus
from mplaunch._platform.cgroup import cpu_limit, pids_limit

V1_MOUNTS = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
32 25 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
33 25 0:30 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
"""
V2_MOUNTS = "35 30 0:31 {root} /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/kubepods/pod1/c1\n",
        V2_MOUNTS.format(root="/"),
        {"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "150000 100000\n", "sys/fs/cgroup/cpu.max": "max 100000\n"},
    )
    assert cpu_limit(root) == 1.5


def test_a_quota_changed_while_the_process_runs_is_seen(tmp_path: Path) -> None:
    """Where the limit files are is remembered; what they say is read at every call (docker update --cpus)."""
    quota = tmp_path / "sys/fs/cgroup/job/cpu.max"
    root = _tree(
        tmp_path, "0::/job\n", V2_MOUNTS.format(root="/"), {str(quota.relative_to(tmp_path)): "200000 100000\n"}
    )
    assert cpu_limit(root) == 2.0
    quota.write_text("50000 100000\n")
    assert cpu_limit(root) == 0.5
    quota.write_text("max 100000\n")
    assert cpu_limit(root) is None


def test_v2_max_means_no_limit(tmp_path: Path) -> None:
    root = _tree(tmp_path, "0::/\n", V2_MOUNTS.format(root="/"), {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cpu_limit(root) is None


def test_nested_limits_the_smallest_ancestor_wins(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/slice/job/step\n",
        V2_MOUNTS.format(root="/"),
        {
            "sys/fs/cgroup/slice/cpu.max": "200000 100000\n",  # 2 CPUs for the whole slice
            "sys/fs/cgroup/slice/job/cpu.max": "max 100000\n",
            "sys/fs/cgroup/slice/job/step/cpu.max": "800000 100000\n",  # asks for 8, gets 2
        },
    )
    assert cpu_limit(root) == 2.0


def test_v1_quota_through_a_container_mount_root(tmp_path: Path) -> None:
    """Without a cgroup namespace, the container's cgroup is the mount's root: the path maps onto the mount."""
    root = _tree(
        tmp_path,
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n",
        V1_MOUNTS.format(root="/docker/abc"),
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_limit(root) == 2.5


def test_v1_minus_one_means_no_limit_and_hybrid_v2_without_cpu_is_ignored(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "4:cpu,cpuacct:/user.slice\n0::/user.slice\n",
        V1_MOUNTS.format(root="/") + "40 25 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/user.slice/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/user.slice/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_limit(root) is None


def test_escaped_mount_points_and_missing_files_are_handled(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/a b\n",
        "35 30 0:31 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n",
        {"sys/fs/my cgroup/a b/cpu.max": "50000 100000\n"},
    )
    assert cpu_limit(root) == 0.5
    assert cpu_limit(str(tmp_path / "nowhere")) is None


def test_usable_cpu_count_is_the_smaller_of_affinity_and_quota_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    def quota(value: float | None) -> None:  # (and forget the last read: it is kept for a second)
        monkeypatch.setattr(cpus, "cpu_limit", lambda: value)
        monkeypatch.setattr(cpus, "_quota", None)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    quota(2.5)
    assert cpus.usable_cpu_count() == 3
    quota(0.2)
    assert cpus.usable_cpu_count() == 1
    quota(None)
    assert cpus.usable_cpu_count() == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    quota(16.0)
    assert cpus.usable_cpu_count() == 2
    assert policy.resolve_nprocs(5) == 5


def _make_cgroup() -> tuple[Path, str]:
    """A fresh cgroup with a CPU limit of half a CPU, v2 or v1, or skip when this machine does not allow it."""
    name = f"mplaunch-test-{os.getpid()}"
    base = Path("/sys/fs/cgroup")
    candidates = [(base, "cpu.max", "50000 100000"), (base / "cpu", "cpu.cfs_quota_us", "50000")]
    if not (base / "cgroup.controllers").exists() or "cpu" not in (base / "cgroup.subtree_control").read_text():
        candidates = candidates[1:]
    reason = "no writable cgroup hierarchy with the cpu controller"
    for parent, file, text in candidates:
        directory = parent / name
        try:
            directory.mkdir()
        except OSError as error:
            reason = f"cannot create a cgroup under {parent}: {error}"
            continue
        try:
            (directory / file).write_text(text)
        except OSError as error:
            directory.rmdir()
            reason = f"cannot set {file} in a new cgroup: {error}"
            continue
        return directory, file
    pytest.skip(reason)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cgroups are Linux's")
def test_a_real_cgroup_quota_is_seen_by_a_process_moved_into_it() -> None:
    directory, _ = _make_cgroup()
    program = (
        "import os, sys\n"
        "with open(sys.argv[1], 'w') as procs: procs.write(str(os.getpid()))\n"
        "from mplaunch._platform.cpus import usable_cpu_count; from mplaunch._platform.cgroup import cpu_limit\n"
        "print(cpu_limit(), usable_cpu_count())"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", program, str(directory / "cgroup.procs")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
    finally:
        directory.rmdir()
    assert done.returncode == 0, done.stderr
    limit, count = done.stdout.split()
    assert float(limit) == 0.5
    assert int(count) == 1  # half a CPU, rounded up, whatever the affinity mask


def test_the_tightest_pids_limit_along_the_path(tmp_path: Path) -> None:
    """Issue 21: the process limit named in a refusal is the one with the least room (v2 nested, v1 pids)."""
    root = _tree(
        tmp_path,
        "0::/pod/c1\n",
        V2_MOUNTS.format(root="/"),
        {
            "sys/fs/cgroup/pod/c1/pids.max": "max\n",
            "sys/fs/cgroup/pod/c1/pids.current": "3\n",
            "sys/fs/cgroup/pod/pids.max": "64\n",
            "sys/fs/cgroup/pod/pids.current": "60\n",
        },
    )
    assert pids_limit(root) == (64, 60)
    v1 = tmp_path / "v1"
    mounts = "40 25 0:40 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids\n"
    files = {"sys/fs/cgroup/pids/docker/c/pids.max": "100\n", "sys/fs/cgroup/pids/docker/c/pids.current": "7\n"}
    assert pids_limit(_tree(v1, "5:pids:/docker/c\n", mounts, files)) == (100, 7)
    assert pids_limit(_tree(tmp_path / "none", "0::/\n", V2_MOUNTS.format(root="/"), {})) is None


def test_the_cpu_quota_is_read_again_once_it_is_older_than_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches in a loop read the cgroup's quota (up to four files) once a second; a quota changed since
    (``docker update --cpus``) counts from the next read on."""
    from mplaunch._platform import cpus

    quotas = [0.5, 1.0]
    reads: list[float] = []

    def quota() -> float:
        reads.append(quotas[0])
        return quotas[0]

    now = [1000.0]
    monkeypatch.setattr(cpus, "cpu_limit", quota)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(cpus, "_quota", None)
    assert cpus.usable_cpu_count() == 1
    quotas.pop(0)  # the quota changes
    now[0] += cpus.QUOTA_FRESH_FOR / 2
    assert cpus.usable_cpu_count() == 1 and len(reads) == 1
    now[0] += cpus.QUOTA_FRESH_FOR
    assert cpus.usable_cpu_count() == 1 and reads == [0.5, 1.0]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpus.usable_cpu_count() == 1  # the affinity is read at each call
