"""The shared-memory channel, in one process."""

from __future__ import annotations

import gc
import os
import pickle
import resource
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mplaunch._wire import inherited, pickling, transport


def test_round_trip_keeps_values_dtypes_and_views(tmp_path: Path) -> None:
    base = torch.arange(100_000, dtype=torch.float32)
    obj: dict[str, Any] = {
        "base": base,
        "view": base[10:20],
        "small": torch.tensor([1, 2, 3]),
        "bf16": torch.ones(40_000, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "module": torch.nn.Linear(3, 2),
        "other": [1, "two", 3.0],
    }
    transport.dump(obj, str(tmp_path), "x")
    back = transport.load(str(tmp_path), "x", private=False, remove=True)
    assert torch.equal(back["base"], base)
    assert torch.equal(back["view"], base[10:20])
    assert back["view"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    assert back["bf16"].dtype == torch.bfloat16
    assert back["empty"].numel() == 0
    assert torch.equal(back["module"].weight, obj["module"].weight)
    assert back["other"] == obj["other"]
    assert list(tmp_path.iterdir()) == []  # every file unlinked once mapped


def test_small_storages_travel_inline_and_large_ones_in_files(tmp_path: Path) -> None:
    transport.dump([torch.zeros(10), torch.zeros(pickling.INLINE_BYTES // 4)], str(tmp_path), "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.pkl"]
    assert (tmp_path / "x.pkl").stat().st_size < 1024  # the large storage is not in the pickle


def test_result_stays_valid_after_the_files_are_gone(tmp_path: Path) -> None:
    transport.dump(torch.full((1 << 20,), 7.0), str(tmp_path), "x")
    back = transport.load(str(tmp_path), "x", private=False, remove=True)
    assert not any(tmp_path.iterdir())
    assert back.sum().item() == 7.0 * (1 << 20)


def test_private_maps_do_not_see_each_other(tmp_path: Path) -> None:
    transport.dump({"w": torch.zeros(1 << 18)}, str(tmp_path), "payload")
    first = transport.load(str(tmp_path), "payload", private=True, remove=False)
    second = transport.load(str(tmp_path), "payload", private=True, remove=False)
    first["w"].add_(1)
    assert second["w"].sum().item() == 0
    third = transport.load(str(tmp_path), "payload", private=True, remove=False)
    assert third["w"].sum().item() == 0  # the file itself is untouched


def test_mapped_storages_hold_no_file_descriptors(tmp_path: Path) -> None:
    tensors = [torch.zeros(pickling.INLINE_BYTES) for _ in range(300)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    transport.dump(tensors, str(tmp_path), "many")
    before = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        back = transport.load(str(tmp_path), "many", private=True, remove=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(back) == 300
    assert len(os.listdir("/proc/self/fd")) == before


def test_closures_and_locals_fall_back_to_cloudpickle(tmp_path: Path) -> None:
    offset = 5

    def local(x: int) -> int:
        return x + offset

    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(local)
    transport.dump(local, str(tmp_path), "f")
    assert transport.load(str(tmp_path), "f", private=False, remove=True)(1) == 6


def test_the_object_appears_only_when_complete(tmp_path: Path) -> None:
    assert transport.load(str(tmp_path), "x", private=False, remove=False, missing_ok=True) is None
    transport.dump(1, str(tmp_path), "x")
    assert transport.load(str(tmp_path), "x", private=False, remove=False, missing_ok=True) == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_loading_what_was_never_written_and_removing_what_was(tmp_path: Path) -> None:
    """A rank that wrote no outcome: ``missing_ok`` says so with None, else FileNotFoundError. A loaded
    object's files are removed, the data file with them, so the launch directory ends empty."""
    assert transport.load(str(tmp_path), "x", private=False, remove=True, missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        transport.load(str(tmp_path), "x", private=False, remove=True)
    transport.dump({"small": 1}, str(tmp_path), "small")
    transport.dump({"big": torch.ones(1 << 16)}, str(tmp_path), "big")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.bin", "big.pkl", "small.pkl"]
    assert transport.load(str(tmp_path), "small", private=False, remove=True) == {"small": 1}
    assert transport.load(str(tmp_path), "big", private=False, remove=True)["big"].sum() == 1 << 16
    assert list(tmp_path.iterdir()) == []


def test_mapped_tensors_are_ordinary_tensors(tmp_path: Path) -> None:
    """Issue 10: a mapped argument reported is_shared(), so torch's fd sharing (DataLoader workers, queues)
    sent a descriptor that did not exist. Mapped storages are ordinary CPU storages now."""
    transport.dump(torch.arange(100_000, dtype=torch.float32), str(tmp_path), "payload")
    back = transport.load(str(tmp_path), "payload", private=True, remove=False)
    assert not back.is_shared()
    back.share_memory_()  # moves into shared memory of its own, as for any tensor
    assert back.is_shared()
    assert back[99_999].item() == 99_999
    saved = tmp_path / "saved.pt"
    torch.save(back, saved)
    assert torch.equal(torch.load(saved), torch.arange(100_000, dtype=torch.float32))


def test_numpy_arrays_travel_out_of_band(tmp_path: Path) -> None:
    """Issue 10: NumPy arrays were copied through the pickle; now they are pickle-5 buffers in the data file,
    mapped by the reader without a copy."""
    array = np.arange(1 << 20, dtype=np.float64)
    obj = {"array": array, "fortran": np.asfortranarray(np.ones((512, 256)))}
    transport.dump(obj, str(tmp_path), "x")
    assert (tmp_path / "x.pkl").stat().st_size < 4096
    back = transport.load(str(tmp_path), "x", private=False, remove=True)
    assert np.array_equal(back["array"], array)
    assert back["fortran"].flags.f_contiguous
    assert not list(tmp_path.iterdir())
    back["array"][0] = 5.0  # writable, like the original
    assert array[0] == 0.0


def test_mappings_are_released_with_the_last_tensor(tmp_path: Path) -> None:
    transport.dump([torch.zeros(1 << 18), np.zeros(1 << 15)], str(tmp_path), "x")
    back = transport.load(str(tmp_path), "x", private=True, remove=True)

    def mapped() -> int:
        with open("/proc/self/maps") as maps:
            return sum(str(tmp_path / "x.bin") in line for line in maps)

    assert mapped() in (1, 2)  # two mappings, or one where the kernel merged them (adjacent, same file)
    del back
    gc.collect()
    assert mapped() == 0


def _refuse_to_rebuild() -> None:
    raise TypeError("cannot rebuild this object here")


class _Unloadable:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_rebuild, ())


def test_an_object_that_fails_to_unpickle_raises_its_own_error(tmp_path: Path) -> None:
    """Adversarial finding: the error came out as "BufferError: cannot close exported pointers exist" (the
    failed unpickling still held a view of the file's mapping when it closed), the real one in __context__."""
    transport.dump({"x": _Unloadable(), "t": torch.ones(1 << 16)}, str(tmp_path), "r")
    with pytest.raises(TypeError, match="cannot rebuild this object here"):
        transport.load(str(tmp_path), "r", private=False, remove=True)
    assert list(tmp_path.iterdir()) == []


def _memory_file() -> int:
    fd = inherited.memory_file("test")
    if fd is None:
        pytest.skip("no memfd_create here")
    return fd


def test_a_result_read_from_a_file_is_the_readers_own_memory(tmp_path: Path) -> None:
    """Issue 21: a result mapped shared from an unlinked file kept its space on the tmpfs charged while the
    caller held it ("No space left" on the 4th kept 5 MiB result in a 16 MiB /dev/shm). Read from a file,
    a result is copied into the reader's memory: no mapping of the file is left."""
    transport.dump({"t": torch.ones(1 << 18), "a": np.ones(1 << 15)}, str(tmp_path), "x")
    back = transport.load(str(tmp_path), "x", private=False, remove=True)
    with open("/proc/self/maps") as maps:
        assert str(tmp_path) not in maps.read()
    assert back["t"].sum().item() == 1 << 18 and back["a"].sum() == 1 << 15 and not list(tmp_path.iterdir())
    back["a"][0] = 5.0  # writable


def test_memory_file_round_trip_keeps_only_the_data() -> None:
    """A result written to a memory file comes back mapped; the header and the pickle are cut off the file
    once read, so what stays allocated is the data alone."""
    fd = _memory_file()
    try:
        base = torch.arange(1 << 18, dtype=torch.float32)
        value: dict[str, Any] = {"base": base, "view": base[5:9], "a": np.arange(1 << 15), "ints": list(range(10**5))}
        transport.dump_fd(value, fd)
        back = transport.load_fd(fd, result=True)
        assert torch.equal(back["base"], base) and back["view"][0].item() == 5.0 and back["ints"] == value["ints"]
        assert np.array_equal(back["a"], value["a"])
        assert os.fstat(fd).st_size == (1 << 20) + (1 << 18)  # the two pieces, page-aligned: no pickle
    finally:
        os.close(fd)
    assert back["base"].sum().item() == base.sum().item()  # the mapping outlives the descriptor


def test_a_result_mapped_from_a_memory_file_stays_private_after_a_fork() -> None:
    """Issue 37: a result was mapped shared, so a process the caller forked later (its own os.fork(), a
    DataLoader worker, a fork Pool) wrote into the caller's tensor and array. Mapped copy-on-write, the
    child's write copies the page; the caller's own write is not seen by the child either."""
    fd = _memory_file()
    try:
        transport.dump_fd({"t": torch.ones(1 << 16), "a": np.ones(1 << 14)}, fd)
        back = transport.load_fd(fd, result=True)
    finally:
        os.close(fd)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes its copy, then waits for the parent's write and reports what it sees
        code = 1
        try:
            back["t"].numpy().fill(0)
            back["a"].fill(0)
            os.close(write)
            os.read(read, 1)
            code = 0 if back["t"][0].item() == 0 and back["a"][0] == 0 else 2
        finally:
            os._exit(code)
    os.close(read)
    back["t"][0] = 5.0
    os.write(write, b"x")
    os.close(write)
    assert os.waitpid(pid, 0)[1] == 0  # the child saw only its own writes
    assert back["t"][1:].sum().item() == (1 << 16) - 1 and back["t"][0].item() == 5.0
    assert back["a"].sum() == 1 << 14


def test_memory_file_payloads_are_private_to_each_reader() -> None:
    fd = _memory_file()
    try:
        transport.dump_fd({"w": torch.zeros(1 << 18)}, fd)
        first, second = transport.load_fd(fd, result=False), transport.load_fd(fd, result=False)
        first["w"].add_(1)
        assert second["w"].sum().item() == 0 and transport.load_fd(fd, result=False)["w"].sum().item() == 0
    finally:
        os.close(fd)


def test_an_incomplete_memory_file_holds_no_object() -> None:
    """A worker killed while writing leaves no trailer: the reader finds nothing, as with a missing file."""
    fd = _memory_file()
    try:
        assert transport.load_fd(fd, result=True, missing_ok=True) is None
        os.write(fd, b"x" * 100)
        assert transport.load_fd(fd, result=True, missing_ok=True) is None
        with pytest.raises(FileNotFoundError):
            transport.load_fd(fd, result=True)
        transport.dump_fd(7, fd)
        assert transport.load_fd(fd, result=True) == 7
    finally:
        os.close(fd)


def test_a_plain_record_written_by_the_standard_pickler_reads_back_whole() -> None:
    """``plain=True`` (a rank's scalar or ``None``) skips mplaunch's pickler, and a small one mplaunch's
    unpickler too (the trailer says so); a large one is mapped as any other; a value written after it in the
    same file replaces it, and a plain one written after a value with data replaces that."""
    fd = _memory_file()
    try:
        for value in (None, True, 7, 2.5, 3 + 4j, "text", b"bytes", "x" * (1 << 17)):
            transport.dump_fd(value, fd, plain=True)
            assert transport.load_fd(fd, result=False) == value
        transport.dump_fd({"t": torch.ones(1 << 15)}, fd)  # replaces the plain one: data first, then the pickle
        assert transport.load_fd(fd, result=True)["t"].sum().item() == 1 << 15
        transport.dump_fd(None, fd, plain=True)
        assert os.fstat(fd).st_size < 1 << 10  # the data is gone with it
        assert transport.load_fd(fd, result=True) is None and os.fstat(fd).st_size == 0  # read: nothing kept
        assert transport.load_fd(fd, result=True, missing_ok=True) is None
    finally:
        os.close(fd)


def test_closing_other_memory_files_spares_a_number_reused_by_another_file(tmp_path: Path) -> None:
    """A forked worker closes the memory files it inherited from the descriptors noted when they were made;
    a noted number that now names another file (closed behind mplaunch's back, then reused) stays open, and a
    number in ``keep`` stays open too."""
    kept, stale = _memory_file(), _memory_file()
    other = _memory_file()
    os.close(stale)  # not through close_quietly: still noted
    with open(tmp_path / "file", "w") as file:
        assert file.fileno() == stale  # the lowest free number
        inherited.close_memory_files({kept})
        os.fstat(file.fileno())  # still open
    os.fstat(kept)
    with pytest.raises(OSError):
        os.fstat(other)
    inherited.close_quietly(kept)
