"""Objects that multiprocessing sends only to a starting process: recognised while the payload is pickled,
written as placeholders, resolved from the objects the reader received with its start; in one process."""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import multiprocessing.context
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from mplaunch._wire import start_objects, transport


class Unknown:
    """A class of another library that, like multiprocessing's, refuses to pickle outside a process start."""

    def __reduce__(self) -> Any:
        multiprocessing.context.assert_spawning(self)
        return Unknown, ()


@dataclasses.dataclass
class Plain:
    x: int


def test_start_objects_become_placeholders_resolved_by_the_reader(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue, lock, value = context.Queue(), context.Lock(), context.RawValue("i", 7)
    receiver, sender = context.Pipe()
    call = {"queue": queue, "again": [queue], "lock": lock, "value": value, "pipe": sender, "t": torch.ones(3)}
    try:
        found = transport.dump(call, str(tmp_path), "x", start_objects=True)
        assert [id(obj) for obj in found] == [id(queue), id(lock), id(value), id(sender)]  # each once, in order
        back = transport.load(str(tmp_path), "x", private=True, remove=True, start_objects=found)
        assert back["queue"] is queue
        assert back["again"][0] is queue
        assert back["lock"] is lock
        assert back["value"] is value
        assert back["pipe"] is sender
        assert torch.equal(back["t"], torch.ones(3))
    finally:
        for each in (receiver, sender, queue):
            each.close()


def test_without_the_option_they_are_refused_and_a_reader_without_them_fails(tmp_path: Path) -> None:
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    with pytest.raises(RuntimeError, match="through inheritance"):
        transport.dump([queue], str(tmp_path), "results")  # results are never sent with a start
    transport.dump([queue], str(tmp_path), "x", start_objects=True)
    with pytest.raises(pickle.UnpicklingError, match="sent with the process start"):
        transport.load(str(tmp_path), "x", private=True, remove=True)
    queue.close()


def test_an_unknown_class_that_refuses_is_found_by_its_reduction(tmp_path: Path) -> None:
    unknown = Unknown()
    found = transport.dump({"u": unknown, "p": Plain(1)}, str(tmp_path), "x", start_objects=True)
    assert found == [unknown]
    back = transport.load(str(tmp_path), "x", private=True, remove=True, start_objects=found)
    assert back["u"] is unknown
    assert back["p"] == Plain(1)


def test_types_are_judged_once_per_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pass over large arguments: one dict look-up per object, the type judged once."""
    judged: list[type] = []
    kind_of = start_objects.kind_of

    def judge(kind: type) -> int:
        judged.append(kind)
        return kind_of(kind)

    monkeypatch.setattr(start_objects, "kind_of", judge)
    assert transport.dump([Plain(i) for i in range(1000)], str(tmp_path), "x", start_objects=True) == []
    assert set(judged) == {Plain, type}
    assert len(judged) == 2  # the instances, and the class itself
    transport.remove(str(tmp_path), "x")


def test_raw_shared_ctypes_are_start_objects_and_plain_ctypes_are_not() -> None:
    raw = multiprocessing.get_context("spawn").RawArray("d", 4)
    assert start_objects.is_start_object(raw, start_objects.kind_of(type(raw)))
    plain = ctypes.c_int(3)
    assert not start_objects.is_start_object(plain, start_objects.kind_of(type(plain)))
    assert start_objects.kind_of(Plain) == start_objects.NEVER


def test_the_rehearsal_finds_a_lock_of_a_fork_context() -> None:
    spawn_lock, fork_lock = multiprocessing.get_context("spawn").Lock(), multiprocessing.get_context("fork").Lock()
    assert start_objects.rehearse([spawn_lock]) is None
    failure = start_objects.rehearse([spawn_lock, fork_lock])
    assert failure is not None
    assert failure[0] is fork_lock
    assert "fork context" in str(failure[1])
    assert multiprocessing.context.get_spawning_popen() is None  # left as found


def _every_kind() -> dict[str, Any]:
    import socket

    import torch.multiprocessing

    context = multiprocessing.get_context("spawn")
    lock = context.Lock()
    made: dict[str, Any] = {
        name: getattr(context, name)()
        for name in ("Queue", "SimpleQueue", "JoinableQueue", "Lock", "RLock", "Semaphore", "BoundedSemaphore")
    }
    made |= {"Condition": context.Condition(lock), "Event": context.Event(), "Barrier": context.Barrier(2)}
    made |= {"Value": context.Value("i"), "Array": context.Array("d", 3), "RawValue": context.RawValue("i")}
    made |= {"RawArray": context.RawArray("d", 3), "Pipe": context.Pipe()[0], "socket": socket.socket()}
    torch_context = torch.multiprocessing.get_context("spawn")
    made |= {"torch Queue": torch_context.Queue(), "torch SimpleQueue": torch_context.SimpleQueue()}
    return made


def test_every_kind_is_recognised_and_passes_the_rehearsal(tmp_path: Path) -> None:
    made = _every_kind()
    try:
        found = transport.dump(made, str(tmp_path), "x", start_objects=True)
        assert len(found) == len(made)
        assert start_objects.rehearse(found) is None  # multiprocessing would send each with a start
        back = transport.load(str(tmp_path), "x", private=True, remove=True, start_objects=found)
        assert all(back[name] is obj for name, obj in made.items())
    finally:
        for obj in made.values():
            if hasattr(obj, "close"):
                obj.close()
