"""Every way of starting Python, under every start method: the worker always finds the function.

Each entry point runs one subprocess that calls a decorated function once per start method (spawn, forkserver,
fork). The function takes an object of a class and a function of the same module as arguments, and returns an
object of that class, so the function, its arguments' class and function, and the result's class all cross
the process boundary. Whatever a worker cannot import by the same name from the same file travels by value;
everything else by reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import zipapp
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
METHODS = ("spawn", "forkserver", "fork")

#: The user's code: one decorated function per start method, a class and a helper function for its arguments.
CODE = """
import dataclasses
from mplaunch import parallel, worker_info

@dataclasses.dataclass
class Box:
    value: int

def twice(box):
    return Box(2 * box.value)

@parallel(nprocs=1, start_method="spawn", timeout=120)
def on_spawn(box, how):
    return how(box)

@parallel(nprocs=1, start_method="forkserver", timeout=120)
def on_forkserver(box, how):
    return how(box)

@parallel(nprocs=2, start_method="fork", timeout=120)
def on_fork(box, how):
    return how(box)

def main():
    for name, function in [("spawn", on_spawn), ("forkserver", on_forkserver), ("fork", on_fork)]:
        result = function(Box(21), twice)
        print("result", name, type(result).__name__, isinstance(result, Box), result.value, flush=True)
    return 0
"""

GUARD = """
if __name__ == "__main__":
    main()
"""

Entry = Callable[[Path], "tuple[list[str], str | None, list[Path]]"]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _package(root: Path, main: str = "") -> None:
    """``pkg/__init__.py``, ``pkg/mod.py`` (the code, guarded) and, if given, ``pkg/__main__.py``."""
    _write(root / "pkg" / "__init__.py", "")
    _write(root / "pkg" / "mod.py", CODE + GUARD)
    if main:
        _write(root / "pkg" / "__main__.py", main)


def script(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    return [sys.executable, str(_write(tmp / "script.py", CODE + GUARD))], None, []


def module(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    _package(tmp)
    return [sys.executable, "-m", "pkg.mod"], None, []


def package_main(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    _package(tmp, main=CODE + GUARD)
    return [sys.executable, "-m", "pkg"], None, []


def console_script(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    """The wrapper pip writes for ``[project.scripts] tool = "pkg.mod:main"``, run by the environment's python."""
    _package(tmp / "site")
    wrapper = _write(
        tmp / "bin" / "tool",
        f"""\
        #!{sys.executable}
        # -*- coding: utf-8 -*-
        import re
        import sys
        from pkg.mod import main
        if __name__ == "__main__":
            sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
            sys.exit(main())
        """,
    )
    wrapper.chmod(0o755)
    return [str(wrapper)], None, [tmp / "site"]


def zip_app(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    source = tmp / "app"
    _write(source / "__main__.py", CODE + GUARD)
    zipapp.create_archive(source, tmp / "app.pyz")
    return [sys.executable, str(tmp / "app.pyz")], None, []


def command(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    return [sys.executable, "-c", CODE + GUARD], None, []


def stdin(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    return [sys.executable, "-"], CODE + GUARD, []


def by_file_path(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    """An experiment runner: the module is loaded from its file under a name no sys.path entry provides."""
    _write(tmp / "experiments" / "exp.py", CODE)
    runner = """
        import importlib.util, os, sys
        if __name__ == "__main__":
            spec = importlib.util.spec_from_file_location("exp", os.path.join("experiments", "exp.py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules["exp"] = module
            spec.loader.exec_module(module)
            module.main()
    """
    return [sys.executable, str(_write(tmp / "runner.py", runner))], None, []


def removed_path(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    """A plugin system: the plugin is imported through a sys.path entry that is removed afterwards."""
    _write(tmp / "plugins" / "plugin.py", CODE)
    runner = """
        import os, sys
        if __name__ == "__main__":
            plugins = os.path.abspath("plugins")
            sys.path.insert(0, plugins)
            import plugin
            sys.path.remove(plugins)
            plugin.main()
    """
    return [sys.executable, str(_write(tmp / "runner.py", runner))], None, []


def run_path(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    _write(tmp / "script.py", CODE + GUARD)
    runner = 'import runpy\nrunpy.run_path("script.py", run_name="__main__")\n'
    return [sys.executable, str(_write(tmp / "runner.py", runner))], None, []


def pdb(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    return [sys.executable, "-m", "pdb", str(_write(tmp / "script.py", CODE + GUARD))], "c\nq\n", []


def cprofile(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    return [sys.executable, "-m", "cProfile", str(_write(tmp / "script.py", CODE + GUARD))], None, []


def trace(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    ignored = os.pathsep.join({sys.prefix, sys.base_prefix, sys.exec_prefix, str(REPO)})
    return (
        [sys.executable, "-m", "trace", "--count", f"--coverdir={tmp / 'cover'}", f"--ignore-dir={ignored}"]
        + [str(_write(tmp / "script.py", CODE + GUARD))],
        None,
        [],
    )


def ipython_run(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
    ipython = Path(sys.executable).with_name("ipython")
    _write(tmp / "script.py", CODE + GUARD)
    return [str(ipython), "--no-banner", "--quick", "-c", "%run script.py"], None, []


def _pytest(mode: str) -> Entry:
    def entry(tmp: Path) -> tuple[list[str], str | None, list[Path]]:
        _write(tmp / "tests_here" / "test_user.py", CODE + "\n\ndef test_main():\n    assert main() == 0\n")
        options = ["-p", "no:cacheprovider", "-q", "-s", f"--import-mode={mode}", "--rootdir", str(tmp)]
        return [sys.executable, "-m", "pytest", *options, "tests_here/test_user.py"], None, []

    return entry


ENTRIES: dict[str, Entry] = {
    "script": script,
    "-m pkg.mod": module,
    "-m pkg": package_main,
    "console-script": console_script,
    "zipapp": zip_app,
    "-c": command,
    "stdin": stdin,
    "file-path": by_file_path,
    "removed-sys-path": removed_path,
    "runpy.run_path": run_path,
    "pdb": pdb,
    "cProfile": cprofile,
    "trace": trace,
    "ipython-%run": ipython_run,
    "pytest-prepend": _pytest("prepend"),
    "pytest-append": _pytest("append"),
    "pytest-importlib": _pytest("importlib"),
}


def run_in_session(
    args: list[str], stdin: str | None, cwd: Path, paths: Sequence[Path] = (), timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in a session of its own; fail if any process of that session outlives it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, paths)])}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("PYTEST_ADDOPTS", None)
    process = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(stdin, timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.communicate()
    _assert_session_ends(process.pid)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _assert_session_ends(session: int, within: float = 10.0) -> None:
    def members() -> list[psutil.Process]:
        found = []
        for candidate in psutil.process_iter():
            try:
                if os.getsid(candidate.pid) == session and candidate.status() != psutil.STATUS_ZOMBIE:
                    found.append(candidate)
            except (OSError, psutil.Error):
                continue
        return found

    deadline = time.monotonic() + within
    while (left := members()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for stray in left:
        stray.kill()
    assert not left, f"stray processes after the program ended: {[(p.pid, p.cmdline()) for p in left]}"


def _run_entry(entry: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    args, stdin_text, paths = ENTRIES[entry](tmp)
    return run_in_session(args, stdin_text, tmp, paths)


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[Any]]:
    """Run the selected entry points two at a time (each is one mostly single-threaded program, and CI has
    2 cores); every one has ended, with its session checked, before the first test of the matrix starts."""
    selected = [
        str(item.callspec.params["entry"])
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.originalname == "test_every_entry_point_on_every_start_method"
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {entry: pool.submit(_run_entry, entry, tmp_path_factory.mktemp("entry")) for entry in selected}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first one waits for the whole matrix (about a minute on 2 idle cores)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_point_on_every_start_method(matrix: dict[str, Future[Any]], entry: str) -> None:
    done = matrix[entry].result()
    results = re.findall(r"result (\w+) (\w+) (\w+) (\d+)", done.stdout)  # pdb's prompt may precede one
    assert results == [(method, "Box", "True", "42") for method in METHODS], done.stdout + done.stderr
    assert "LaunchRefusedError:" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr


PACKAGE_MAIN = """
from mplaunch import parallel

@parallel(nprocs=2, start_method="spawn")
def double(x):
    return 2 * x

if __name__ == "__main__":
    print(double(21))
"""


def test_python_m_package_with_the_function_in_its_main_module(tmp_path: Path) -> None:
    """The issue's first minimal input: ``python -m pkg``, the function in ``pkg/__main__.py``."""
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "__main__.py", PACKAGE_MAIN)
    done = run_in_session([sys.executable, "-m", "pkg"], None, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42"]


EXPERIMENT = """
from mplaunch import parallel

@parallel(nprocs=2, start_method="spawn")
def run(x):
    return 10 * x
"""

LOADER = """
import importlib.util, sys

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("exp", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["exp"] = module
    spec.loader.exec_module(module)
    print(module.run(1))
"""


def test_module_loaded_by_file_path(tmp_path: Path) -> None:
    """The issue's second minimal input: a module loaded from its file under a name no sys.path entry has."""
    experiment = _write(tmp_path / "experiments" / "exp.py", EXPERIMENT)
    loader = _write(tmp_path / "loader.py", LOADER)
    done = run_in_session([sys.executable, str(loader), str(experiment)], None, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10"]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["runpy.run_path", "pdb", "ipython-%run", "cProfile"])  # script: test_scripts.py
def test_a_missing_guard_is_judged_in_the_users_script(tmp_path: Path, entry: str) -> None:
    """A call at import time is refused where workers run the user's script again, naming the script's line and
    call, never a runner's (runpy's, pdb's, IPython's); cProfile's workers run cProfile, not the script: no
    refusal, the call just works."""
    args, stdin_text, paths = ENTRIES[entry](tmp_path)
    (tmp_path / "script.py").write_text(textwrap.dedent(CODE) + "\nprint(on_spawn(Box(21), twice))\n")
    done = run_in_session(args, "c\nq\nq\n" if entry == "pdb" else stdin_text, tmp_path, paths)
    if entry == "cProfile":
        assert "Box(value=42)" in done.stdout, done.stderr
        return
    output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # IPython colours its tracebacks
    line = len(textwrap.dedent(CODE).splitlines()) + 2
    assert f"LaunchRefusedError: Your script script.py (line {line}) called the parallel function on_spawn()" in output
    assert 'if __name__ == "__main__":\n        print(on_spawn(Box(21), twice))\n' in output
    assert "Box(value=42)" not in done.stdout  # no worker started
