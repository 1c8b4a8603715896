"""The one rule for how a call travels: by reference what a worker can import by the same name from the same
file, by value anything else; judged without importing or launching anything."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mplaunch._wire import importable, pickling
from mplaunch._wire.importable import WorkerImports
from tests import workers

MODULE = """
import dataclasses

@dataclasses.dataclass
class Box:
    value: int

def twice(box):
    return Box(2 * box.value)
"""


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``exp``, loaded from ``tmp_path/experiments/exp.py`` as experiment runners do (no sys.path entry)."""
    path = tmp_path / "experiments" / "exp.py"
    path.parent.mkdir()
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("exp", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "exp", module)
    spec.loader.exec_module(module)
    yield module


def _imports() -> WorkerImports:
    return WorkerImports(importable.worker_sys_path(), sys.modules.get("__main__"))


def test_importable_modules_travel_by_reference() -> None:
    imports = _imports()
    for obj in (workers.identity, workers.Point, torch.nn.Linear, torch.Tensor, pickle.dumps, importable.guard_spans):
        assert imports.can_import(obj), obj
        assert not imports.needs_value(obj), obj


def test_a_module_loaded_by_file_path_travels_by_value(loaded: types.ModuleType) -> None:
    imports = _imports()
    assert not imports.module_importable("exp")
    assert imports.needs_value(loaded.twice)
    assert imports.needs_value(loaded.Box)


def test_the_same_name_must_resolve_to_the_same_file(
    loaded: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "exp.py").write_text("")  # another module of the same name on the worker's sys.path
    monkeypatch.syspath_prepend(str(other))
    assert not _imports().module_importable("exp")
    monkeypatch.syspath_prepend(str(tmp_path / "experiments"))  # now the name finds the file it came from
    assert _imports().module_importable("exp")


def test_a_plugin_whose_sys_path_entry_is_gone_travels_by_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plugin_for_mplaunch_test.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        plugin = importlib.import_module("plugin_for_mplaunch_test")
        assert _imports().can_import(plugin.twice)
        sys.path.remove(str(tmp_path))
        assert _imports().needs_value(plugin.twice)
    finally:
        sys.modules.pop("plugin_for_mplaunch_test", None)


def test_main_objects_follow_how_multiprocessing_prepares_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "script.py"
    script.write_text('def top():\n    pass\nif __name__ == "__main__":\n    class Inside:\n        pass\n')
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), vars(main))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert _imports().can_import(main.top)  # python script.py: the worker runs it again
    assert _imports().needs_value(main.Inside)  # ... but skips its guard
    main.__spec__ = importlib.machinery.ModuleSpec("pkg.__main__", None, origin=str(script))
    assert _imports().needs_value(main.top)  # python -m pkg: never run again
    main.__spec__ = None
    other = {"__name__": "__main__"}
    exec("def profiled():\n    pass\n", other)  # cProfile/trace: the script runs in a dict of their own
    assert _imports().needs_value(other["profiled"])


def test_a_main_object_the_scripts_rerun_does_not_define_travels_by_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker runs the script again: only what its module-level code defines outside the guard is there.
    A function exec'd into __main__ (defined after the workers started, at a prompt) is found by name in the
    parent and was sent by reference: the worker failed with "Can't get attribute 'late_fn'"."""
    script = tmp_path / "script.py"
    script.write_text("def top():\n    pass\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), vars(main))
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec("def late_fn():\n    pass\n", vars(main))  # a name the script never binds
    assert _imports().needs_value(main.late_fn)
    top = vars(main)["top"]
    exec("def top():\n    return 1\n", vars(main))  # the script's name, redefined at a prompt
    assert _imports().needs_value(vars(main)["top"])
    vars(main)["top"] = top
    assert _imports().can_import(top)


def test_pickled_by_value_even_where_the_parent_finds_it(loaded: types.ModuleType) -> None:
    data, _ = pickling.pickle_object((loaded.twice, loaded.Box(21)), False, _imports())
    del sys.modules["exp"]  # as in a worker, where no "exp" can be imported
    function, box = pickle.loads(data)
    assert function(box).value == 42


def test_a_list_of_ints_stays_a_plain_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(file: io.BytesIO, imports: object = None) -> None:
        raise AssertionError("cloudpickle used for plain data")

    monkeypatch.setattr(pickling, "_CloudPickler", refuse)
    value = list(range(10**6))
    data, pickler = pickling.pickle_object(value, False, _imports())
    assert not pickler.storages
    assert not pickler.buffers
    assert pickle.loads(data) == value


def test_the_view_is_reused_until_sys_path_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = importable.worker_imports()
    assert importable.worker_imports() is first
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importable.worker_imports() is not first


def test_the_fork_server_preloads_only_what_it_can_import(loaded: types.ModuleType) -> None:
    from mplaunch import parallel
    from mplaunch._parent import launch

    imports = _imports()
    assert "tests.workers" in launch._preload(imports, parallel(workers.identity))
    assert "exp" not in launch._preload(imports, parallel(loaded.twice))
