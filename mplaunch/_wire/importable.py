"""What a ``spawn``/``forkserver`` worker can import by name (it re-runs the main module but ``*.__main__``, ``-c``,
stdin and IPython): what it finds under the same name, from the same file, travels by reference, else by value.
Nothing is imported to decide: finders are asked, once per module."""

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
    """Return the ``sys.path`` a worker started now gets (``multiprocessing.spawn.get_preparation_data``)."""
    path = list(sys.path)
    original: str | None = getattr(process, "ORIGINAL_DIR", None)
    if "" in path and original is not None:
        path[path.index("")] = original
    return tuple(path)


def rerun_main_file(main: ModuleType | None) -> str | None:
    """Return the file a worker re-runs as its ``__main__``, or ``None`` when multiprocessing runs none."""
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
    """What a worker started now can import by name (the module docstring's rule)."""

    def __init__(self, sys_path: Sequence[str], main: ModuleType | None) -> None:
        self.sys_path = list(sys_path)
        self.main = main
        self.main_file = rerun_main_file(main)
        self._modules: dict[str, tuple[ModuleType, bool]] = {}

    def can_import(self, obj: Any) -> bool:
        """Return whether a worker finds ``obj`` by its module and name."""
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
        """Return whether ``obj`` must travel by value (one not found by its name is left to the picklers)."""
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
        """Return whether a worker's ``import name`` finds the file the parent's module came from."""
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
        """Ask the finders where ``name`` would be found, with the worker's ``sys.path``."""
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
    """Return the :class:`WorkerImports` of a worker started now (cached while ``sys.path`` and ``__main__`` stay)."""
    main = sys.modules.get("__main__")
    path = worker_sys_path()
    key = (path, id(main), getattr(main, "__file__", None), getattr(getattr(main, "__spec__", None), "name", None))
    if _cached_imports and _cached_imports[0][0] == key and _cached_imports[0][1].main is main:
        return _cached_imports[0][1]
    imports = WorkerImports(path, main)
    _cached_imports[:] = [(key, imports)]
    return imports


def _is_guard(node: ast.AST) -> TypeGuard[ast.If]:
    """Return whether ``node`` is an ``if`` whose test involves ``__name__`` and ``"__main__"``."""
    if not isinstance(node, ast.If):
        return False
    parts = list(ast.walk(node.test))
    has_name = any(isinstance(n, ast.Name) and n.id == "__name__" for n in parts)
    return has_name and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in parts)


def guard_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """Return the line spans of the ``__main__`` guards (any spelling: ``==``, ``in``, ``and``, negated)."""
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
    """A script's guard spans, and the names its module-level code binds outside them."""

    def __init__(self, tree: ast.Module) -> None:
        self.spans = guard_spans(tree)
        outside: set[str] = set()
        _bind(tree.body, outside)
        self.outside = frozenset(outside)


_sources: dict[tuple[str, float], _Source | None] = {}


def script_source(path: str) -> _Source | None:
    """Parse a script once per mtime; ``None`` if it cannot be read."""
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
    """Return whether re-running the script ``path`` defines ``obj`` by name and, for a function, by code."""
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
