"""What a ``spawn`` or ``forkserver`` worker can import by name: the one rule for how a call travels.

A worker started with ``spawn`` or ``forkserver`` does not inherit the parent's modules. multiprocessing
prepares it from two facts (``multiprocessing.spawn.get_preparation_data`` and ``prepare``):

* its ``sys.path`` is the parent's at launch time (``''`` replaced by the directory Python started in);
* its ``__main__`` is the parent's main module run again as ``__mp_main__``: by name for ``python -m mod``,
  by path for a script; never for a module named ``__main__`` or ``*.__main__`` (``python -m pkg``, a
  zipapp), nor for ``python -c``, stdin, the REPL or IPython, where there is nothing to run.

An object (a function or a class) travels by reference only when the worker will find it under the same
name in a module that resolves to the same file; anything else (a module loaded from a file path, a plugin
whose ``sys.path`` entry is gone, ``pkg/__main__.py``, a script run by cProfile or trace in a namespace of
their own, a function defined under the ``__main__`` guard, a closure) travels by value, with cloudpickle.
Nothing is imported to decide: finders are asked where a name would be found, and the answer is cached per
module.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from multiprocessing import process
from types import ModuleType
from typing import Any, TypeGuard

from mplaunch._frames import resolve


def worker_sys_path() -> tuple[str, ...]:
    """The ``sys.path`` a worker started now gets, as ``multiprocessing.spawn.get_preparation_data`` sends it."""
    path = list(sys.path)
    original: str | None = getattr(process, "ORIGINAL_DIR", None)
    if "" in path and original is not None:
        path[path.index("")] = original
    return tuple(path)


def rerun_main_file(main: ModuleType | None) -> str | None:
    """The file a worker runs again as its ``__main__`` (the parent's script or ``python -m`` module), or
    ``None`` when multiprocessing runs none (``python -m pkg``, a zipapp, ``python -c``, stdin, IPython)."""
    if main is None:
        return None
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None  # multiprocessing.spawn._fixup_main_from_name skips these
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    if name is None and os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None  # multiprocessing.spawn._fixup_main_from_path skips it
    return path


class WorkerImports:
    """What a worker started now can import by name; see the module docstring for the rule."""

    def __init__(self, sys_path: Sequence[str], main: ModuleType | None) -> None:
        self.sys_path = list(sys_path)
        self.main = main
        self.main_file = rerun_main_file(main)
        self._modules: dict[str, tuple[ModuleType, bool]] = {}

    def can_import(self, obj: Any) -> bool:
        """Whether a worker finds ``obj`` (a function, class or decorated function) by its module and name."""
        module_name = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if not isinstance(module_name, str) or not isinstance(qualname, str) or "<locals>" in qualname:
            return False
        module = self.main if module_name == "__main__" else sys.modules.get(module_name)
        if module is None or module is not sys.modules.get(module_name) or resolve(module_name, qualname) is not obj:
            return False  # e.g. a script that cProfile or trace run in a namespace of their own
        if module_name != "__main__":
            return self.module_importable(module_name)
        return self.main_file is not None and _defined_by_script(obj, qualname, self.main_file)

    def needs_value(self, obj: Any) -> bool:
        """Whether ``obj`` (a function or class) must travel by value: it belongs to ``__main__`` and the
        worker's ``__main__`` will not define it, or to a module the worker cannot import by that name from the
        same file. An importable module's object that is not found by its name (a C type, a renamed function)
        is left to pickle and cloudpickle, which know such cases."""
        module_name = getattr(obj, "__module__", None)
        if module_name == "__main__":
            return not self.can_import(obj)
        module = sys.modules.get(module_name) if isinstance(module_name, str) else None
        if module is None or not isinstance(module_name, str):
            return False
        if getattr(module, "__spec__", None) is None and getattr(module, "__file__", None) is None:
            return True  # made at run time (types.ModuleType): cloudpickle's "dynamic module"
        return not self.module_importable(module_name)

    def module_importable(self, name: str) -> bool:
        """Whether a worker's ``import name`` finds the file the parent's module ``name`` came from."""
        module = sys.modules.get(name)
        if module is None:
            return False
        cached = self._modules.get(name)
        if cached is not None and cached[0] is module:
            return cached[1]
        verdict = self._resolves_alike(name, module)
        self._modules[name] = (module, verdict)
        return verdict

    def _resolves_alike(self, name: str, module: ModuleType) -> bool:
        spec = getattr(module, "__spec__", None)
        if not isinstance(spec, ModuleSpec):
            return False  # made at run time (types.ModuleType): no file to import
        parent, _, _ = name.rpartition(".")
        search: list[str] | None = None
        if parent:  # found where the worker's import of the (same) parent package will look
            if not self.module_importable(parent):
                return False
            search = list(getattr(sys.modules[parent], "__path__", None) or [])
            if not search:
                return False
        found = self._find_spec(name, search)
        return found is not None and _same_origin(found, spec)

    def _find_spec(self, name: str, search: list[str] | None) -> ModuleSpec | None:
        """Ask the import system's finders where ``name`` would be found, with the worker's ``sys.path``."""
        for finder in sys.meta_path:
            try:
                if finder is PathFinder or isinstance(finder, PathFinder):
                    found = PathFinder.find_spec(name, search if search is not None else self.sys_path)
                else:
                    found = finder.find_spec(name, search)
            except Exception:  # noqa: BLE001 - a finder that fails finds nothing
                continue
            if found is not None:
                return found
        return None


def _same_origin(found: ModuleSpec, spec: ModuleSpec) -> bool:
    if found.origin is None or spec.origin is None or not (found.has_location and spec.has_location):
        return found.origin == spec.origin  # built-in, frozen, namespace packages
    return os.path.realpath(found.origin) == os.path.realpath(spec.origin)


_cached_imports: list[tuple[tuple[Any, ...], WorkerImports]] = []


def worker_imports() -> WorkerImports:
    """The :class:`WorkerImports` of a worker started now; reused while ``sys.path`` and ``__main__`` stay."""
    main = sys.modules.get("__main__")
    path = worker_sys_path()
    key = (path, id(main), getattr(main, "__file__", None), getattr(getattr(main, "__spec__", None), "name", None))
    if _cached_imports and _cached_imports[0][0] == key and _cached_imports[0][1].main is main:
        return _cached_imports[0][1]
    imports = WorkerImports(path, main)
    _cached_imports[:] = [(key, imports)]
    return imports


# The __main__ guard in a script's source ------------------------------------------------------------------


def _is_guard(node: ast.AST) -> TypeGuard[ast.If]:
    """An ``if`` whose test involves ``__name__`` and ``"__main__"`` (any spelling)."""
    if not isinstance(node, ast.If):
        return False
    parts = list(ast.walk(node.test))
    has_name = any(isinstance(n, ast.Name) and n.id == "__name__" for n in parts)
    return has_name and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in parts)


def guard_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """Line spans of the ``if`` blocks whose test involves ``__name__`` and ``"__main__"`` (any spelling:
    ``==``, ``in``, combined with ``and``, negated)."""
    return [(node.lineno, node.end_lineno or node.lineno) for node in ast.walk(tree) if _is_guard(node)]


def _bind(statements: list[ast.stmt], names: set[str]) -> None:
    """Collect the names that module-level ``statements`` bind outside a ``__main__`` guard."""
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            continue
        for target in _targets(node):
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if _is_guard(node):
            _bind(node.orelse, names)
            continue
        for field in ("body", "orelse", "finalbody"):
            _bind(getattr(node, field, []), names)
        for handler in getattr(node, "handlers", []):
            _bind(handler.body, names)


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        return [node.target]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return []


class _Source:
    """What a script's source says about its ``__main__`` guard: the guard's line spans, and the names its
    module-level code binds outside the guard (what a worker's re-run of the script defines)."""

    def __init__(self, tree: ast.Module) -> None:
        self.spans = guard_spans(tree)
        outside: set[str] = set()
        _bind(tree.body, outside)
        self.outside = frozenset(outside)


_sources: dict[tuple[str, float], _Source | None] = {}


def script_source(path: str) -> _Source | None:
    """The guard facts of a script, parsed once per version of the file; ``None`` if it cannot be read."""
    try:
        key = (path, os.stat(path).st_mtime)
    except OSError:
        return None
    if key not in _sources:
        try:
            with open(path, encoding="utf-8") as file:
                _sources[key] = _Source(ast.parse(file.read()))
        except (OSError, SyntaxError, ValueError):
            _sources[key] = None
    return _sources[key]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # "<string>", "<stdin>", a file since removed
        return False


def _defined_by_script(obj: Any, qualname: str, path: str) -> bool:
    """Whether a worker's re-run of the script ``path`` defines the ``__main__`` object ``obj`` itself: its
    name is bound by the script's module-level code outside the ``__main__`` guard, and its code (for a
    function) comes from that file, outside the guard. A function defined under the guard, typed at a
    prompt, ``exec``'d, or defined after the workers started under a name the script does not bind, is not."""
    source = script_source(path)
    if source is None or qualname.split(".")[0] not in source.outside:
        return False
    code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__wrapped__", None), "__code__", None)
    if code is None:
        return True  # a class: its name is what the script binds
    if code.co_filename != path and not _same_file(code.co_filename, path):
        return False
    line = code.co_firstlineno
    return not any(start <= line <= end for start, end in source.spans)
