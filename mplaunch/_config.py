"""The launch options, validated once, when they are made (when a function is decorated)."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict

from mplaunch._env import check_extra_env
from mplaunch._errors import InvalidOptionError
from mplaunch._recovery_options import RestartOn, check_restart_on, check_signals

#: The fields a ``prefix_output`` template may use.
PREFIX_FIELDS = ("rank", "local_rank", "node_rank", "pid")
#: The prefix of ``prefix_output=True``.
DEFAULT_PREFIX = "[rank {rank}] "

StartMethod = Literal["spawn", "fork", "forkserver"]

StartMethod.__doc__ = """The start methods mplaunch accepts (``multiprocessing``'s names), for annotations:
``def run(start_method: mplaunch.StartMethod) -> None``."""


class LaunchOptions(TypedDict, total=False):
    """The keyword options of :func:`~mplaunch.parallel` and ``ParallelFunction.options`` (all optional), for
    annotating ``**options`` with ``typing.Unpack`` (PEP 692). Their meaning and defaults are
    :class:`ParallelConfig`'s fields; ``return_all`` is not among them: it changes the return type, so it is
    a parameter of its own (``parallel(return_all=True)``)."""

    nprocs: int | Literal["auto"]
    start_method: StartMethod | None
    timeout: float | None
    stall_timeout: float | None
    grace_period: float
    backend: str | None
    prefix_output: bool | str
    console_ranks: Iterable[int] | None
    log_dir: str | os.PathLike[str] | None
    nnodes: int | None
    node_rank: int | None
    rdzv_endpoint: str | None
    max_restarts: int
    rdzv_timeout: float
    devices: int | Sequence[int] | None
    cpu_binding: Literal["cores", "numa"] | None
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None
    preempt_signals: Iterable[int | signal.Signals]
    preempt_grace: float
    restart_on: RestartOn
    restart_delay: float
    post_mortem: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The launch options of one decorated function, validated when made: a ``ParallelConfig`` cannot exist with
    an invalid value. :func:`~mplaunch.parallel` makes one from its keyword options, and
    ``ParallelFunction.options`` with :func:`dataclasses.replace`; every field's default is the option's.

    Attributes:
        nprocs: number of worker processes started by one call, or ``"auto"`` (see :func:`resolve_nprocs`).
        start_method: ``"spawn"``, ``"fork"``, ``"forkserver"``, or ``None`` to choose at call time.
        return_all: return a list of every rank's value ordered by rank instead of rank 0's value.
        timeout: seconds the whole launch may take (restarts included), or ``None`` for no limit.
        stall_timeout: seconds a rank that has called :func:`~mplaunch.heartbeat` may go without calling it
            again before the launch counts it stalled (:class:`~mplaunch.StallError`), or ``None`` to watch
            no rank.
        grace_period: seconds a worker gets between SIGTERM and SIGKILL when the launch stops it.
        backend: process-group backend each worker initialises around the function (``"gloo"``,
            ``"nccl"``, ``"auto"``, ...), or ``None`` to leave process groups to the function.
        prefix_output: prefix each line a worker writes with ``[rank N] `` (``True``), or with a template
            of the fields ``rank``, ``local_rank``, ``node_rank`` and ``pid`` (e.g. ``"{rank}|{pid} "``).
        console_ranks: the ranks whose output reaches the console, or ``None`` for every rank (any collection
            of ints is accepted and kept as a ``frozenset``).
        log_dir: a directory where each rank's output is also written to ``rank{N}.log``, or ``None`` (any
            path is accepted and kept as an absolute ``str``).
        nnodes: number of nodes, or ``None`` to read it from the environment (one node if unset).
        node_rank: this node's index, or ``None`` (informative: c10d rendezvous orders the nodes).
        rdzv_endpoint: ``host[:port]`` of the c10d rendezvous on a multi-node launch.
        max_restarts: how often all workers are restarted after a failure (by mplaunch on one node, by
            torch.distributed.elastic on several), as torchrun's ``--max-restarts``.
        rdzv_timeout: seconds to wait for every node to join a multi-node launch, and for the ranks of
            :class:`~mplaunch.Workers` to start (not counted in their first call's ``timeout``).
        devices: the CUDA devices of each call: a number of free ones, their indices (kept as a tuple), or
            ``None`` for every visible device, not pooled.
        cpu_binding: ``"cores"`` (each rank on its own cores), ``"numa"`` (each rank on one NUMA node's
            cores), or ``None`` (the parent's affinity).
        env: extra variables for every rank (kept as a ``dict``), or a function of the rank returning them.
        preempt_signals: signals that preempt the launch instead of stopping it (any iterable of signal numbers
            is accepted and kept as a tuple of :class:`signal.Signals`; ``()``: none). Handled by each node
            of a multi-node launch, which passes the notice on to the others.
        preempt_grace: seconds the ranks get, once preempted, to save and return before they are stopped.
        restart_on: the failures ``max_restarts`` restarts: ``None`` for every failure, exception classes (a
            class is kept as a one-class tuple), or a predicate ``(failure) -> bool`` run in the parent. One
            node only.
        restart_delay: seconds before the first restart, doubled for each further one, at most 60. One node
            only.
        post_mortem: open pdb, on the caller's terminal, at the failing frame of the first rank that raises.

    Raises:
        InvalidOptionError: a field has a wrong type or value; the message names it, the value and what is
            allowed. (An unknown field name is a ``TypeError``, as for any call.)
    """

    nprocs: int | Literal["auto"] = "auto"
    start_method: StartMethod | None = None
    return_all: bool = False
    timeout: float | None = None
    stall_timeout: float | None = None
    grace_period: float = 5.0
    backend: str | None = None
    prefix_output: bool | str = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    rdzv_timeout: float = 600.0
    devices: int | tuple[int, ...] | None = None
    cpu_binding: Literal["cores", "numa"] | None = None
    env: dict[str, str] | Callable[[int], Mapping[str, str]] | None = None
    preempt_signals: tuple[signal.Signals, ...] = ()
    preempt_grace: float = 60.0
    restart_on: RestartOn = None
    restart_delay: float = 0.0
    post_mortem: bool = False

    def __post_init__(self) -> None:
        _check_nprocs(self.nprocs)
        _check_start_method(self.start_method)
        if not isinstance(self.return_all, bool):
            raise InvalidOptionError(f"return_all={self.return_all!r} is not valid: pass True or False.")
        _check_prefix(self.prefix_output)
        if self.cpu_binding not in (None, "cores", "numa"):
            raise InvalidOptionError(
                f"cpu_binding={self.cpu_binding!r} is not valid: pass 'cores' (each rank on its own cores), "
                "'numa' (each rank on one NUMA node), or None."
            )
        if not isinstance(self.post_mortem, bool):
            raise InvalidOptionError(f"post_mortem={self.post_mortem!r} is not valid: pass True or False.")
        _check_seconds("timeout", self.timeout, "> 0, or None for no limit", optional=True)
        _check_seconds("stall_timeout", self.stall_timeout, "> 0, or None to watch no rank", optional=True)
        _check_seconds("grace_period", self.grace_period, ">= 0", allow_zero=True)
        _check_seconds("rdzv_timeout", self.rdzv_timeout, "> 0")
        _check_seconds("preempt_grace", self.preempt_grace, ">= 0", allow_zero=True)
        _check_seconds("restart_delay", self.restart_delay, ">= 0", allow_zero=True)
        _check_backend(self.backend)
        _check_whole("nnodes", self.nnodes, 1)
        _check_whole("node_rank", self.node_rank, 0)
        _check_whole("max_restarts", self.max_restarts, 0, " of restarts after a worker failure (0: none)")
        if self.rdzv_endpoint is not None and (not isinstance(self.rdzv_endpoint, str) or not self.rdzv_endpoint):
            raise InvalidOptionError(
                f"rdzv_endpoint={self.rdzv_endpoint!r} is not valid: pass 'host:port', e.g. 'node0:29400'."
            )
        if self.log_dir is not None and (
            not isinstance(self.log_dir, (str, os.PathLike)) or not os.fspath(self.log_dir)
        ):
            raise InvalidOptionError(f"log_dir={self.log_dir!r} is not valid: pass a directory path, or None.")
        if self.nnodes is not None and self.node_rank is not None and self.node_rank >= self.nnodes:
            raise InvalidOptionError(
                f"node_rank={self.node_rank!r} is not valid with nnodes={self.nnodes}: pass 0 to {self.nnodes - 1}."
            )
        normalised = {
            "console_ranks": None if self.console_ranks is None else _check_ranks(self.console_ranks),
            "log_dir": None if self.log_dir is None else os.path.abspath(os.fspath(self.log_dir)),
            "timeout": None if self.timeout is None else float(self.timeout),
            "stall_timeout": None if self.stall_timeout is None else float(self.stall_timeout),
            "grace_period": float(self.grace_period),
            "rdzv_timeout": float(self.rdzv_timeout),
            "devices": _check_devices(self.devices),
            "env": self.env
            if self.env is None or callable(self.env)
            else check_extra_env(self.env, "env", devices=self.devices is not None),
            "preempt_signals": check_signals(self.preempt_signals),
            "preempt_grace": float(self.preempt_grace),
            "restart_on": check_restart_on(self.restart_on),
            "restart_delay": float(self.restart_delay),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)


#: The option names, in the order of :class:`ParallelConfig`'s fields (one list for the decorator and options()).
OPTIONS = tuple(field.name for field in dataclasses.fields(ParallelConfig))


def make_config(**options: Any) -> ParallelConfig:
    """Return the :class:`ParallelConfig` of these keyword options (defaults for the others).

    Raises:
        InvalidOptionError: an option has a wrong type or value.
        TypeError: an option name that does not exist; the message lists the valid ones.
    """
    _check_names(options, OPTIONS)
    return ParallelConfig(**options)


def replace_options(config: ParallelConfig, overrides: Mapping[str, Any]) -> ParallelConfig:
    """``config`` with the options in ``overrides`` replaced (every option but ``return_all``).

    Raises:
        InvalidOptionError: an option has a wrong type or value.
        TypeError: an option name that does not exist, or ``return_all``; the message lists the valid ones.
    """
    _check_names(overrides, tuple(LaunchOptions.__annotations__))
    return dataclasses.replace(config, **overrides)


def _check_names(options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}: the options are {', '.join(allowed)}.")


def _check_nprocs(nprocs: object) -> None:
    if nprocs != "auto" and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise InvalidOptionError(
            f"nprocs={nprocs!r} is not valid: pass a whole number of processes >= 1 (e.g. nprocs=2), or 'auto'."
        )


def _check_start_method(start_method: object) -> None:
    available = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in available:
        known = ("fork", "spawn", "forkserver")
        what = "is not available on this platform" if start_method in known else "is no start method"
        raise InvalidOptionError(
            f"start_method={start_method!r} {what}: use one of "
            f"{', '.join(repr(m) for m in available)}, or None to let mplaunch choose."
        )


def _check_seconds(name: str, value: object, allowed: str, *, allow_zero: bool = False, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        ok = False
    else:
        ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise InvalidOptionError(f"{name}={value!r} is not valid: pass a number of seconds {allowed}.")


def _check_whole(name: str, value: object, low: int, what: str = "") -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise InvalidOptionError(f"{name}={value!r} is not valid: pass a whole number{what} >= {low}.")


def _check_ranks(console_ranks: Iterable[int]) -> frozenset[int]:
    message = (
        f"console_ranks={console_ranks!r} is not valid: pass the ranks whose output should reach the console as "
        "a collection of whole numbers >= 0 (e.g. console_ranks=[0]), or None for every rank."
    )
    if isinstance(console_ranks, (str, bytes)):
        raise InvalidOptionError(message)
    try:
        ranks = frozenset(console_ranks)
    except TypeError:
        raise InvalidOptionError(message) from None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise InvalidOptionError(message)
    return ranks


def _check_prefix(prefix: object) -> None:
    if isinstance(prefix, bool):
        return
    message = (
        f"prefix_output={prefix!r} is not valid: pass True ('[rank N] '), False, or a template of the fields "
        f"{', '.join('{' + name + '}' for name in PREFIX_FIELDS)}, e.g. '{{rank}}|{{pid}} '."
    )
    if not isinstance(prefix, str):
        raise InvalidOptionError(message)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(prefix) if name is not None}
    except ValueError:
        raise InvalidOptionError(message) from None
    unknown = sorted(field for field in fields if field.split(".")[0].split("[")[0] not in PREFIX_FIELDS)
    if unknown:
        raise InvalidOptionError(f"{message} Unknown field(s): {', '.join(map(repr, unknown))}.")
    if not fields:  # "yes", "True": a flag was meant, not a constant prefix
        raise InvalidOptionError(f"{message} A template names at least one field.")
    try:
        prefix.format(**dict.fromkeys(PREFIX_FIELDS, 0))
    except (ValueError, KeyError, IndexError, AttributeError, TypeError):
        raise InvalidOptionError(message) from None


def _check_devices(devices: object) -> int | tuple[int, ...] | None:
    message = (
        f"devices={devices!r} is not valid: pass a number of CUDA devices >= 1 (any free ones, e.g. devices=1), "
        "a list of distinct device indices (e.g. devices=[2, 3]), or None for every visible device."
    )
    if devices is None:
        return None
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise InvalidOptionError(message)
        return devices
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise InvalidOptionError(message)
    indices = tuple(devices)
    if (
        not indices
        or len(set(indices)) != len(indices)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)
    ):
        raise InvalidOptionError(message)
    return indices


def _check_backend(backend: str | None) -> None:
    if backend is None or backend == "auto":
        return
    import torch.distributed as dist

    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    if not isinstance(backend, str) or backend.lower() not in known:
        raise InvalidOptionError(
            f"backend={backend!r} is not valid: use one of {', '.join(repr(b) for b in known)}, 'auto' (nccl when "
            "there is a CUDA device per worker, else gloo), or None to initialise process groups yourself."
        )
