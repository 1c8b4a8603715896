"""The limits a launch can hit while starting workers, and errors that name them and their fix: the process limit
(``pids.max``, ``RLIMIT_NPROC``), the environment ``exec`` accepts (``E2BIG``), the open-files limit, and a Unix
socket's path length (a long ``TMPDIR``). Multiprocessing reports them as a bare ``BlockingIOError``, a spawned
worker that "exited with code 255", or an ``EOFError`` from a dead fork server."""

from __future__ import annotations

import contextlib
import errno
import mmap
import multiprocessing.process
import multiprocessing.util
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping

from mplaunch._errors import LaunchRefusedError, RemoteTraceback
from mplaunch._platform.cgroup import pids_limit

#: Linux's MAX_ARG_STRLEN: the longest single argument or ``NAME=value`` that ``exec`` accepts.
MAX_ARG_STRLEN = 32 * mmap.PAGESIZE
#: The longest path of a Unix socket (``sun_path`` holds 108 bytes, the final NUL included).
SUN_PATH_MAX = 107
#: What multiprocessing adds to the temporary directory for the fork server's socket.
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
#: Where a shorter directory for that socket is looked for, in order (CPython 3.13's own list).
_SHORT_BASES = ("/tmp", "/var/tmp", "/usr/tmp")
_FILES = (errno.EMFILE, errno.ENFILE)


def _limit(kind: int) -> str:
    soft = resource.getrlimit(kind)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return None


def _process_text() -> str:
    """Describe the process limits here (e.g. ``pids.max=64 (63 in use), RLIMIT_NPROC=unlimited``) and the fix."""
    pids = pids_limit()
    cgroup = "" if pids is None else f"the cgroup's pids.max={pids[0]} ({pids[1]} in use), "
    root = " (not enforced for root)" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
    return (
        f"the process limit ({cgroup}RLIMIT_NPROC={_limit(resource.RLIMIT_NPROC)}{root}; every worker and each of "
        "its threads counts). Raise it (docker run --pids-limit, Kubernetes podPidsLimit, systemd TasksMax, "
        "ulimit -u), or start fewer workers"
    )


def _files_text() -> str:
    open_now = _open_fds()
    now = "" if open_now is None else f", {open_now} open in this process now"
    return (
        f"the open-files limit (RLIMIT_NOFILE={_limit(resource.RLIMIT_NOFILE)}{now}; a launch holds a few "
        "descriptors per worker). Raise it (ulimit -n 65536, docker run --ulimit nofile=65536:65536, or "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)) at the start of the script)"
    )


def environment_problem(environ: Mapping[str, str], argv: list[str] | None = None) -> str | None:
    """Say why ``exec`` would refuse a new Python with ``environ`` (``E2BIG``), or return ``None``."""
    sizes = [len(f"{name}={value}".encode(errors="surrogateescape")) + 1 for name, value in environ.items()]
    for name, size in zip(environ, sizes, strict=True):
        if size > MAX_ARG_STRLEN:
            return (
                f"the environment variable {name} is {size} bytes and exec accepts at most {MAX_ARG_STRLEN} "
                "bytes per variable (Linux's MAX_ARG_STRLEN)"
            )
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        return None
    pointer = 8
    total = sum(sizes) + pointer * len(sizes)
    total += sum(len(arg) + 1 + pointer for arg in (argv or [sys.executable, "-c", "x" * 200]))
    if arg_max > 0 and total > arg_max:
        largest = max(environ, key=lambda name: len(environ[name]))
        return (
            f"the environment and arguments take {total} bytes and exec accepts at most {arg_max} in all "
            f"(ARG_MAX; the largest variable is {largest})"
        )
    return None


def check_exec_environment(environ: Mapping[str, str], start_method: str) -> None:
    """Refuse a spawn worker (or fork server) whose ``exec`` would fail with ``E2BIG`` ("exit code 255")."""
    problem = environment_problem(environ)
    if problem is not None:
        raise LaunchRefusedError(_environment_text(problem, start_method))


def _environment_text(problem: str, start_method: str) -> str:
    return (
        f"cannot start {start_method!r} workers: {problem}, so starting a new Python fails (E2BIG). Unset or "
        "shorten it (pass large data as an argument of the function instead), or use start_method='fork', "
        "which does not exec."
    )


def short_socket_directory() -> None:
    """Give multiprocessing a shorter temporary directory when ``TMPDIR`` is too long for a socket, as CPython 3.13."""
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is not None or len(os.fsencode(tempfile.gettempdir())) + _SOCKET_SUFFIX <= SUN_PATH_MAX:
        return
    for base in _SHORT_BASES:
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            break
    else:
        return  # the bind fails, and start_refused names the cause
    directory = tempfile.mkdtemp(prefix="pymp-", dir=base)
    multiprocessing.util.Finalize(
        None,
        multiprocessing.util._remove_temp_dir,  # type: ignore[attr-defined]
        args=(shutil.rmtree, directory),
        exitpriority=-100,
    )
    config["tempdir"] = directory


def start_refused(error: BaseException, start_method: str, rank: int, nprocs: int) -> LaunchRefusedError | None:
    """Return the error to raise instead of ``error`` when a limit is (likely) the cause, else ``None``."""
    what = f"could not start rank {rank} of {nprocs} ({start_method}): {type(error).__name__}: {error}"
    code = getattr(error, "errno", None)
    if isinstance(error, OSError) and code in _FILES:
        return LaunchRefusedError(f"{what}. It reached {_files_text()}.")
    if isinstance(error, OSError) and "AF_UNIX path too long" in str(error):
        return LaunchRefusedError(
            f"{what}. The fork server's socket would be in {multiprocessing.util.get_temp_dir()!r}, longer than "
            f"the {SUN_PATH_MAX} bytes a Unix socket's path may have: set TMPDIR to a shorter directory."
        )
    if isinstance(error, OSError) and code == errno.E2BIG:
        return LaunchRefusedError(_environment_text("the environment is too large for exec", start_method))
    if isinstance(error, OSError) and code == errno.EAGAIN:
        return LaunchRefusedError(f"{what}. The system refused a new process: it reached {_process_text()}.")
    if isinstance(error, OSError) and code == errno.ENOMEM:
        return LaunchRefusedError(
            f"{what}. The system has no memory for a new process: free memory or start "
            f"fewer workers. If memory is not short, the cause is {_process_text()}."
        )
    if isinstance(error, (EOFError, ConnectionError)):  # BrokenPipeError, ConnectionResetError...
        environment = environment_problem(os.environ)
        causes = [_process_text(), _files_text()]
        soft, open_now = resource.getrlimit(resource.RLIMIT_NOFILE)[0], _open_fds()
        if soft != resource.RLIM_INFINITY and open_now is not None and soft - open_now < 16:  # few files left
            causes.reverse()
        if environment is not None:
            causes.insert(0, f"an environment too large for exec: {environment}")
        listed = "; or ".join(causes)
        helper = "the fork server" if start_method == "forkserver" else "the new process"
        return LaunchRefusedError(
            f"{what}. {helper.capitalize()} ended while starting it; a limit of this machine "
            f"or container is the likely cause: {listed}."
        )
    return None


@contextlib.contextmanager
def open_files_explained() -> Iterator[None]:
    """Turn the parent's (not a worker's) ``EMFILE``/``ENFILE`` during set-up into an error naming the limit."""
    try:
        yield
    except OSError as error:
        if error.errno not in _FILES or isinstance(error.__cause__, RemoteTraceback):
            raise
        raise LaunchRefusedError(
            f"the launch could not open a descriptor ({error}): it reached {_files_text()}."
        ) from error
