"""The launch options, validated once, when they are made (when a function is decorated)."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeGuard, get_args

from mplaunch._env import check_extra_env
from mplaunch._errors import InvalidOptionError
from mplaunch._recovery_options import RestartOn, check_restart_on, check_signals

#: The fields a ``prefix_output`` template may use.
PREFIX_FIELDS = ("rank", "local_rank", "node_rank", "pid")

StartMethod = Literal["spawn", "fork", "forkserver"]

StartMethod.__doc__ = """The start methods mplaunch accepts (``multiprocessing``'s names), for annotations:
``def run(start_method: mplaunch.StartMethod) -> None``."""


class LaunchOptions(TypedDict, total=False):
    """The keyword options of [`parallel()`][mplaunch.parallel] and ``ParallelFunction.options`` (all optional), for
    annotating ``**options`` with ``typing.Unpack`` (PEP 692). Their meaning and defaults are
    [`ParallelConfig`][mplaunch.ParallelConfig]'s fields; ``return_all`` is not among them: it changes the return type,
    so it is a parameter of its own (``parallel(return_all=True)``)."""

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
    seed: int | None


#: The ways of calling, as the options reference's table names them.
MODES = ("call", "submit()", "generator function", "Workers(...)", "Workers.run/submit", "multi-node")
#: The options of each call of warm workers, not of their ranks' start (a decorated function's own apply).
PER_CALL = ("return_all", "timeout", "stall_timeout", "preempt_signals", "preempt_grace")

_RESTARTED = "the ranks a restart would start have lost the state a failed call needs; the next call starts them again"
_THREAD = (
    "a submitted call runs in a thread, and Python runs signal handlers in the main thread only: call "
    "future.preempt() from your own handler, e.g. signal.signal(signal.SIGTERM, lambda *_: future.preempt())"
)
_ONE_NODE = "Workers run on one node"
_ONE_NODE_STREAM = "a generator function runs on one node, and there is no rendezvous of nodes to name or bound"
_STREAM_NODES = "a generator's values stream from the ranks of one node: return them instead"
_AGENT_WATCHES = "torch elastic's agent watches the ranks of each node; heartbeat() does nothing there"
_AGENT_RESTARTS = "torch elastic's agent on each node restarts that node's ranks on its own"
_NODES_ONLY = {"generator function": _ONE_NODE_STREAM, "Workers(...)": _ONE_NODE}
_WITH_NODES = {"call": "with nnodes > 1", "submit()": "with nnodes > 1"}
_EACH_CALL = {"Workers(...)": "per call", "Workers.run/submit": "its call"}


def _option(default: Any, *, refused: Mapping[str, str] | None = None, note: Mapping[str, str] | None = None) -> Any:
    """Return a field of :class:`ParallelConfig` with, per mode of :data:`MODES`, why it is refused or a note."""
    return dataclasses.field(default=default, metadata={"refused": dict(refused or {}), "note": dict(note or {})})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The launch options of one decorated function (``fn.config``) or of warm workers, validated when made: no
    ``ParallelConfig`` holds an invalid value. [`parallel()`][mplaunch.parallel] makes one from its keyword options,
    ``ParallelFunction.options`` with ``dataclasses.replace()``; each field's default is the option's. Each field's
    docstring is the one source of the options reference, whose table says in which ways of calling each option works.

    Raises:
        InvalidOptionError: a field has a wrong type or value; the message names it, the value and what is
            allowed. (An unknown field name is a ``TypeError``, as for any call.)
    """

    nprocs: int | Literal["auto"] = _option("auto")
    """Worker processes per call (per node): a whole number >= 1, or ``"auto"``: the call's devices with
    ``devices=``, else the visible CUDA devices when there are any, else the usable CPU cores (the affinity
    mask, capped by a container's CPU quota)."""
    start_method: StartMethod | None = _option(None)
    """``"spawn"``, ``"fork"`` or ``"forkserver"`` (``multiprocessing``'s names); ``None``: ``fork`` in an interactive
    session (REPL, IPython, Jupyter) where fork exists and forked workers could use CUDA (neither CUDA nor its
    driver initialised here, e.g. by ``torch.cuda.is_available()``), else ``spawn``."""
    return_all: bool = _option(False, note={"generator function": "(rank, value) pairs", "multi-node": "this node's"})
    """Return a list of every rank's value, ordered by rank, instead of rank 0's value."""
    timeout: float | None = _option(None, note=_EACH_CALL)
    """Seconds the whole call may take (restarts included), or ``None`` for no limit. Then each rank's stacks are
    collected (about a second at most), the ranks are stopped (a warm call is interrupted), and ``LaunchTimeoutError``
    carries the stacks and names where each rank was. Multi-node: each node stops its own workers, without stacks."""
    stall_timeout: float | None = _option(None, refused={"multi-node": _AGENT_WATCHES}, note=_EACH_CALL)
    """Seconds a rank that has called ``mplaunch.heartbeat()`` may go without calling it again; then every
    rank's stacks are collected, the ranks are stopped and ``StallError`` names the rank (a worker failure:
    ``max_restarts`` restarts it). A rank that never beats is not watched; ``None``: none is."""
    grace_period: float = _option(5.0)
    """Seconds from SIGTERM to SIGKILL when stopping the ranks early (a warm call: from the interrupt to the stop)."""
    backend: str | None = _option(None)
    """A ``torch.distributed`` backend (``"gloo"``, ``"nccl"``, ...) or ``"auto"`` (nccl with a CUDA device
    per rank, else gloo): each rank runs ``init_process_group`` with it before the function (binding
    ``cuda:LOCAL_RANK`` first for nccl) and ``destroy_process_group`` after it, also when it raises (warm
    ranks: once, around all their calls). ``None``: the function manages process groups itself (a function that
    calls ``init_process_group`` with a backend set fails with a ``ValueError`` that says so)."""
    prefix_output: bool | str = _option(False)
    """Prefix every line a rank writes to its stdout or stderr (fd 1 and 2: ``print``, logging, C code,
    subprocesses) with ``[rank N] `` (``True``), or with a template of the fields ``rank``, ``local_rank``,
    ``node_rank`` and ``pid``, e.g. ``"{rank}|{pid} "``."""
    console_ranks: frozenset[int] | None = _option(None)
    """The ranks whose output reaches the console, e.g. ``[0]`` (any collection of ints; kept as a ``frozenset``); the
    others' is dropped unless ``log_dir`` is set (as torchrun's ``--local-ranks-filter``). ``None``: every rank's."""
    log_dir: str | None = _option(None)
    """A directory (created before any rank starts) where each rank's output also goes to ``rank{N}.log``,
    overwritten at each call (a restart appends, after a ``--- restart N ---`` line); the stacks of a timeout
    or a stall go to ``rank{N}.stacks``; with ``backend="nccl"``, NCCL's flight recorder dumps there on a
    collective's timeout. Any path; kept absolute. Launches (and ``Workers``) that run at the same time, in
    this process or another, cannot share one: the second is refused with ``LaunchRefusedError`` (the nodes of
    one multi-node launch share it)."""
    nnodes: int | None = _option(None, refused={"generator function": _STREAM_NODES, "Workers(...)": _ONE_NODE})
    """Machines taking part, each running the call with ``nprocs`` ranks; ``None``: ``MPLAUNCH_NNODES`` (or
    SLURM's, in an ``srun`` step with one task per node), else 1. With more than one, the call launches
    through torch elastic with c10d rendezvous, and returns rank 0's value on every node."""
    node_rank: int | None = _option(None, refused=_NODES_ONLY, note=_WITH_NODES)
    """This node's index (``MPLAUNCH_NODE_RANK``, ``SLURM_NODEID``); informative, as c10d rendezvous orders
    the nodes itself."""
    rdzv_endpoint: str | None = _option(None, refused=_NODES_ONLY, note=_WITH_NODES)
    """``host[:port]`` every node can reach, where node 0's agent hosts the rendezvous
    (``MPLAUNCH_RDZV_ENDPOINT``; default port 29400)."""
    max_restarts: int = _option(0, refused={"Workers(...)": _RESTARTED})
    """Times all ranks are stopped and started again after a worker failure (torchrun's ``--max-restarts``): each
    restart is announced with a ``RestartWarning``, ranks read the count from ``worker_info().restart_count`` to resume
    from a checkpoint, ``timeout`` bounds all attempts together, and the failure raised at the end carries the earlier
    ones in ``earlier_attempts``. A generator function's values of a failed attempt were delivered; the next attempt's
    follow them. Multi-node: torch elastic's restarts."""
    rdzv_timeout: float = _option(
        600.0,
        refused={"generator function": _ONE_NODE_STREAM},
        note={**_WITH_NODES, "Workers(...)": "the ranks' start"},
    )
    """Seconds to wait for every node to join a multi-node launch; for ``Workers``, seconds their ranks may
    take to start, apart from the first call's ``timeout``."""
    devices: int | tuple[int, ...] | None = _option(None)
    """The call's CUDA devices: indices among the visible ones (``[2, 3]``, kept as a tuple), a count of any
    free ones (``2``), or ``None``: every visible device, not pooled. The ranks see exactly these, in order,
    through ``CUDA_VISIBLE_DEVICES``, so ``cuda:LOCAL_RANK`` is each rank's device. One pool per process: a
    launch whose devices another holds waits for them (a submitted one stays pending)."""
    cpu_binding: Literal["cores", "numa"] | None = _option(None)
    """``"cores"``: each rank pinned to its own whole cores within this process's affinity mask, with
    ``OMP_NUM_THREADS`` their number unless set; ``"numa"``: each rank pinned to one NUMA node's cores
    (round-robin; its GPU's node first with ``devices=``), its memory preferred there; ``None``: the parent's
    affinity, which never changes."""
    env: dict[str, str] | Callable[[int], Mapping[str, str]] | None = _option(None)
    """Extra environment variables for the ranks, set after torchrun's: a mapping (kept as a ``dict``), or a
    function of the rank returning one (called in the parent before any rank starts; in each rank on
    several nodes). Setting a torchrun variable, ``MASTER_ADDR``/``MASTER_PORT``, or
    ``CUDA_VISIBLE_DEVICES`` with ``devices=`` is refused. A spawn rank's interpreter starts with them (a
    forkserver launch with ``env=`` starts its ranks so too); a fork rank gets them before the function runs,
    and refuses a ``PYTHON*`` variable read only as Python starts (start methods guide: "The environment").
    The parent's ``os.environ`` is not changed."""
    preempt_signals: tuple[signal.Signals, ...] = _option(
        (), refused={"submit()": _THREAD}, note={"Workers(...)": "per call", "Workers.run/submit": "its call (run)"}
    )
    """Signals that preempt the call instead of stopping it, e.g. ``(signal.SIGTERM,)`` or SLURM's
    ``(signal.SIGUSR1,)`` (any iterable of signal numbers; kept as a tuple of ``signal.Signals``); ``()``:
    none. When the calling process gets one, no rank is signalled: ``mplaunch.preempted()`` becomes true in
    every rank, the ranks get ``preempt_grace`` seconds to save and return, the rest are then stopped, and
    the call raises ``PreemptedError``. A second signal ends the grace at once. Multi-node: each node
    handles its own signals and passes the notice to the others. SIGKILL and SIGSTOP cannot be caught."""
    preempt_grace: float = _option(60.0, note=_EACH_CALL)
    """Seconds the ranks get, once preempted, to save and return (default 60)."""
    restart_on: RestartOn = _option(None, refused={"Workers(...)": _RESTARTED, "multi-node": _AGENT_RESTARTS})
    """The failures ``max_restarts`` restarts: exception classes (e.g. ``(ConnectionError,
    WorkerExitedError)``; a class is kept as a one-class tuple), or a predicate ``(failure) -> bool`` called
    in the parent (never pickled); ``None``: every failure. Another failure is raised at once."""
    restart_delay: float = _option(
        0.0, refused={"Workers(...)": _RESTARTED, "multi-node": f"{_AGENT_RESTARTS}, at once"}
    )
    """Seconds before the first restart, doubled for each further one, at most 60; the wait counts against
    ``timeout`` and ends at once on ``cancel()``, Ctrl-C or a preemption."""
    post_mortem: bool = _option(False)
    """The first rank that raises opens pdb at its failing line on the caller's terminal, before the others are stopped
    (``q`` or ``c`` ends it). Without a terminal (a notebook), a ``RuntimeWarning`` points to ``fn.debug()``."""
    seed: int | None = _option(None)
    """A whole number >= 0: each rank seeds Python's ``random``, NumPy's global generator and torch's CPU and
    CUDA generators with one 64-bit value made of ``seed`` and its rank, before the function runs. Each rank
    then draws its own numbers, the same at every call with this seed, under every start method; DataLoader
    workers, whose seeds come from their rank's torch generator, differ per rank too (as Lightning's
    ``seed_everything(workers=True)``). Models initialised in the ranks then differ: DDP broadcasts rank 0's
    parameters, else call ``torch.manual_seed(...)`` before building the model. ``None``: every rank starts from
    the parent's random state, so all ranks draw alike (a seeded parent gives identical models, and identical
    augmentations on every rank); a launch from the very state the previous one started from (the parent
    neither seeded nor drew since) draws anew. torchrun starts each rank from its own seed (Python, NumPy)
    and the same one (torch); the script seeds its ranks."""

    def __post_init__(self) -> None:
        _check_nprocs(self.nprocs)
        _check_start_method(self.start_method)
        for name in ("return_all", "post_mortem"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidOptionError(f"{name}={getattr(self, name)!r} is not valid: pass True or False.")
        _check_prefix(self.prefix_output)
        if self.cpu_binding not in (None, "cores", "numa"):
            raise InvalidOptionError(
                f"cpu_binding={self.cpu_binding!r} is not valid: pass 'cores' (each rank on its own cores), "
                "'numa' (each rank on one NUMA node), or None."
            )
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
        if self.seed is not None and not _is_whole(self.seed, 0):
            raise InvalidOptionError(f"seed={self.seed!r} is not valid: pass a whole number >= 0 (e.g. 0), or None.")
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


OPTIONS = tuple(field.name for field in dataclasses.fields(ParallelConfig))
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ParallelConfig)}
_MODE_NAMES = {
    "call": "a call",
    "generator function": "a generator function",
    "multi-node": "a launch on more than one node",
}


def refused_in(mode: str) -> dict[str, str]:
    """Return the options that ``mode`` refuses, with why."""
    return {f.name: reason for f in dataclasses.fields(ParallelConfig) if (reason := f.metadata["refused"].get(mode))}


def check_mode(config: ParallelConfig, mode: str, what: str | None = None) -> None:
    """Raise InvalidOptionError for the first option ``mode`` refuses that ``config`` sets (``what`` names the mode)."""
    for name, reason in refused_in(mode).items():
        value = getattr(config, name)
        default = _DEFAULTS[name]
        if value == default or (name == "nnodes" and value == 1):
            continue
        raise InvalidOptionError(
            f"{name}={value!r} is not valid for {what or _MODE_NAMES.get(mode, mode)}: {reason}. Leave it out "
            f"(default {default!r})."
        )


def call_config(own: ParallelConfig, workers: ParallelConfig, name: str) -> ParallelConfig:
    """Return the options of a call of ``name`` on warm workers: theirs, with its own of PER_CALL (else refused)."""
    overrides = {}
    for field in dataclasses.fields(ParallelConfig):
        value, theirs = getattr(own, field.name), getattr(workers, field.name)
        if value == field.default or value == theirs:
            continue
        if field.name in PER_CALL:
            overrides[field.name] = value
            continue
        raise InvalidOptionError(
            f"{field.name}={value!r} is set on {name}, and Workers.run/submit runs it on ranks that were started "
            f"with {field.name}={theirs!r}: set it on Workers(...), pass {name}.__wrapped__, or call {name}(...) "
            "for a launch of its own."
        )
    return dataclasses.replace(workers, **overrides) if overrides else workers


def make_config(**options: Any) -> ParallelConfig:
    """Return the :class:`ParallelConfig` of these options; TypeError for an unknown name."""
    _check_names(options, OPTIONS)
    return ParallelConfig(**options)


def replace_options(config: ParallelConfig, overrides: Mapping[str, Any]) -> ParallelConfig:
    """Return ``config`` with ``overrides`` replaced; TypeError for an unknown name or ``return_all``."""
    _check_names(overrides, tuple(LaunchOptions.__annotations__))
    return dataclasses.replace(config, **overrides)


def _check_names(options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}: the options are {', '.join(allowed)}.")


def _is_whole(value: object, low: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_nprocs(nprocs: object) -> None:
    if nprocs != "auto" and not _is_whole(nprocs, 1):
        raise InvalidOptionError(
            f"nprocs={nprocs!r} is not valid: pass a whole number of processes >= 1 (e.g. nprocs=2), or 'auto'."
        )


def _check_start_method(start_method: object) -> None:
    available = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in available:
        what = "is not available on this platform" if start_method in get_args(StartMethod) else "is no start method"
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
    if value is not None and not _is_whole(value, low):
        raise InvalidOptionError(f"{name}={value!r} is not valid: pass a whole number{what} >= {low}.")


def _check_ranks(console_ranks: Iterable[int]) -> frozenset[int]:
    message = (
        f"console_ranks={console_ranks!r} is not valid: pass the ranks whose output should reach the console as "
        "a collection of whole numbers >= 0 (e.g. console_ranks=[0]), or None for every rank."
    )
    try:
        ranks = frozenset(console_ranks)
    except TypeError:
        raise InvalidOptionError(message) from None
    if isinstance(console_ranks, (str, bytes)) or not all(_is_whole(r, 0) for r in ranks):
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
    if devices is None or _is_whole(devices, 1):
        return devices
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise InvalidOptionError(message)
    indices = tuple(devices)
    if not indices or len(set(indices)) != len(indices) or not all(_is_whole(i, 0) for i in indices):
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
