"""A worker's torchrun-style environment, and accessors for it. The variables follow torchrun's contract
(https://pytorch.org/docs/stable/elastic/run.html, "Environment Variables"), so code written for torchrun runs
unchanged."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from mplaunch._errors import InvalidOptionError
from mplaunch._wire import flags

#: Variables that describe a rank's place in a job. The parent's values never reach a worker: mplaunch
#: sets each of them per rank. ``MASTER_ADDR``/``MASTER_PORT`` are kept when the user set them.
# fmt: off
RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "MPLAUNCH_HOSTED_MASTER_PORT", "MPLAUNCH_WORKER", flags.FLAG_VARIABLE,
)
# fmt: on

DEFAULT_MASTER_ADDR = "127.0.0.1"

#: Set to 1 in every worker: a parallel function called there runs in-process as that rank (as under torchrun).
WORKER_VARIABLE = "MPLAUNCH_WORKER"

#: In workers, the MASTER_PORT of their launch's store: a launch from a worker that finds it there hosts its own store.
OWN_PORT_VARIABLE = "MPLAUNCH_HOSTED_MASTER_PORT"


def rank_environment(
    rank: int,
    nprocs: int,
    master_addr: str,
    master_port: int,
    *,
    agent_store: bool,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """Return rank ``rank`` of ``nprocs``'s variables as torchrun sets them (``agent_store``: the parent's store)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nprocs),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        WORKER_VARIABLE: "1",
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env[OWN_PORT_VARIABLE] = str(master_port)  # so that a launch from this worker knows it is not the user's
    return env


#: What ``env=`` may not set: each rank's place in the job and the launch's rendezvous store are mplaunch's.
RESERVED_VARIABLES = (*RANK_VARIABLES, "MASTER_ADDR", "MASTER_PORT")


def check_extra_env(env: object, source: str, *, devices: bool = False) -> dict[str, str]:
    """Return ``env`` (``source`` in messages) as a dict of strings, or raise InvalidOptionError (bad, or reserved)."""
    if not isinstance(env, Mapping):
        raise InvalidOptionError(
            f"{source}={env!r} is not valid: pass a mapping of variable names to strings, e.g. "
            "env={'NCCL_DEBUG': 'INFO'}, or a function of the rank returning one."
        )
    wrong = [
        f"{key!r}: {value!r}" for key, value in env.items() if not isinstance(key, str) or not isinstance(value, str)
    ]
    if wrong:
        raise InvalidOptionError(f"{source} is not valid: names and values must be strings; not {', '.join(wrong)}.")
    unheld = [
        f"{key!r}: {value!r}"
        for key, value in env.items()
        if not key or "=" in key or "\0" in key + value or not _encodable(key + value)
    ]
    if unheld:
        raise InvalidOptionError(
            f"{source} is not valid: no environment can hold {', '.join(unheld)}. A name must be non-empty "
            "without '=' or a NUL character, a value without a NUL character, and neither may hold a character "
            f"that the file system encoding ({sys.getfilesystemencoding()}) cannot write, such as a lone surrogate."
        )
    for name in env:
        if name in RESERVED_VARIABLES:
            raise InvalidOptionError(
                f"{source} sets {name}, which mplaunch sets for each rank (torchrun's environment and the "
                "launch's rendezvous store): leave it out (MASTER_ADDR/MASTER_PORT may be set in this "
                "process's own environment)."
            )
        if devices and name == "CUDA_VISIBLE_DEVICES":
            raise InvalidOptionError(
                f"{source} sets CUDA_VISIBLE_DEVICES, which devices= sets for each rank: choose the devices "
                "with devices= only."
            )
    return dict(env)


def replacing(env: Mapping[str, str]) -> dict[str, str | None]:
    """Return ``env`` as changes to an environment: ``None`` removes each other rank variable of the parent's."""
    return {**dict.fromkeys(RANK_VARIABLES), **env}


def apply_environment(environ: os._Environ[str], changes: Mapping[str, str | None]) -> None:
    """Apply ``changes`` to ``environ``: a value sets the variable, ``None`` removes it."""
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


@dataclasses.dataclass(frozen=True, slots=True)
class RankInfo:
    """Where the calling process stands in the job, read from torchrun's environment variables.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this node (the CUDA device index to use).
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node (``GROUP_RANK``).
        restart_count: how often the workers were restarted before this attempt (``TORCHELASTIC_RESTART_COUNT``,
            0 on the first attempt): resume from a checkpoint when it is above 0.
        preempted: whether the launch was preempted, read live at each access (see [`preempted()`][mplaunch.preempted]);
            the other attributes are read once, from the environment.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    restart_count: int = 0

    @property
    def preempted(self) -> bool:
        """Whether this process's launch was preempted, read at each access ([`preempted()`][mplaunch.preempted])."""
        return flags.is_set()


def preempted() -> bool:
    """Return whether the launch running this process was preempted: the parent received one of the launch's
    ``preempt_signals`` (or ``future.preempt()`` was called). The rank should then save its work and return
    within ``preempt_grace`` seconds; the call raises [`PreemptedError`][mplaunch.PreemptedError] in the parent.

    Cheap enough for every step of a training loop: one read of a byte of shared memory, no system call.
    Nothing signals the rank, so its DataLoader workers and process group keep working. True in every rank
    within moments of the signal, and in processes a rank forks (DataLoader workers); ``False`` outside a
    launch with a preemption flag (a plain process, ``fn.debug()``, a run under torchrun).

    Returns:
        ``True`` once the launch was preempted, else ``False``.

    Example:
        ```python title="Fragment: in a decorated function's loop"
        if mplaunch.preempted():
            return save_checkpoint(step)  # within preempt_grace seconds
        ```
    """
    return flags.is_set()


def worker_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Return the calling process's [`RankInfo`][mplaunch.RankInfo], read from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (falling back to ``NODE_RANK``) and ``TORCHELASTIC_RESTART_COUNT``: in an
    mplaunch worker, under torchrun, or in a plain process, which is rank 0 of a world of 1.

    Args:
        environ: the variables to read; ``None`` reads ``os.environ``.

    Raises:
        ValueError: a variable is set to something that is not a whole number.

    Example:
        ```python title="Fragment: in a worker (outside a launch: rank 0 of 1)"
        info = worker_info()
        print(f"rank {info.rank} of {info.world_size}")
        ```
    """
    env = os.environ if environ is None else environ

    def read(name: str, default: int) -> int:
        value = env.get(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} is not a whole number") from None

    world_size = read("WORLD_SIZE", 1)
    return RankInfo(
        rank=read("RANK", 0),
        local_rank=read("LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=read("LOCAL_WORLD_SIZE", world_size),
        node_rank=read("GROUP_RANK", read("NODE_RANK", 0)),
        restart_count=read("TORCHELASTIC_RESTART_COUNT", 0),
    )


def _encodable(text: str) -> bool:
    """Return whether ``os.environ`` can write ``text`` (``os.fsencode``)."""
    try:
        os.fsencode(text)
    except UnicodeError:
        return False
    return True


def whole_number(value: str) -> int | None:
    """Return ``value`` as a whole number of ASCII digits, else ``None`` (``isdigit()`` alone takes ``"³"``)."""
    return int(value) if value.isascii() and value.isdigit() else None


def _count(environ: Mapping[str, str], name: str) -> int:
    found = whole_number(environ.get(name, ""))
    return 1 if found is None else found


def outer_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the launcher this process already runs under as one rank, or ``None``. First match wins:
    ``MPLAUNCH_WORKER=1`` (set in mplaunch's workers): ``"mplaunch"``; ``TORCHELASTIC_RUN_ID`` set:
    ``"torchrun"``; ``SLURM_STEP_ID`` set with more tasks than nodes in the step:
    ``"slurm"``; ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` or ``MV2_COMM_WORLD_SIZE`` > 1: ``"mpi"`` (README,
    "Already launched?"). ``MPLAUNCH_IN_PROCESS=1`` forces ``"forced"``, ``=0`` forces ``None``.

    Raises:
        InvalidOptionError: ``MPLAUNCH_IN_PROCESS`` is set to something other than ``0`` or ``1``.

    Args:
        environ: the variables to read; ``None`` reads ``os.environ``.
    """
    env = os.environ if environ is None else environ
    forced = env.get("MPLAUNCH_IN_PROCESS")
    if forced:
        if forced not in ("0", "1"):
            raise InvalidOptionError(
                f"MPLAUNCH_IN_PROCESS={forced!r} is not valid: set it to 1 (run in-process), 0 (launch)."
            )
        return "forced" if forced == "1" else None
    if env.get(WORKER_VARIABLE) == "1":
        return "mplaunch"
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if env.get("SLURM_STEP_ID") is not None and _count(env, "SLURM_STEP_NUM_TASKS") > _count(
        env, "SLURM_STEP_NUM_NODES"
    ):
        return "slurm"
    if any(_count(env, n) > 1 for n in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")):
        return "mpi"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSetup:
    """Where this node stands in a multi-node launch."""

    nnodes: int
    node_rank: int | None  # if known: c10d rendezvous orders the nodes itself
    rdzv_endpoint: str  # host:port of the c10d store, the same on every node
    run_id: str


DEFAULT_RDZV_PORT = 29400


def node_setup(
    nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None, environ: Mapping[str, str] | None = None
) -> NodeSetup | None:
    """Resolve the multi-node options (arguments, MPLAUNCH_*, SLURM's in a step of a task per node); None: one node."""
    env = os.environ if environ is None else environ
    slurm_per_node = (
        env.get("SLURM_STEP_ID") is not None
        and _count(env, "SLURM_STEP_NUM_NODES") > 1
        and _count(env, "SLURM_STEP_NUM_TASKS") == _count(env, "SLURM_STEP_NUM_NODES")
    )

    def pick(given: Any, name: str, slurm_name: str) -> Any:
        if given is not None:
            return given
        return env.get(name) or (env.get(slurm_name) if slurm_per_node else None)

    count = pick(nnodes, "MPLAUNCH_NNODES", "SLURM_STEP_NUM_NODES")
    count = _whole("nnodes (MPLAUNCH_NNODES)", count) if count is not None else 1
    if count <= 1:
        return None
    rank = pick(node_rank, "MPLAUNCH_NODE_RANK", "SLURM_NODEID")
    endpoint = rdzv_endpoint or env.get("MPLAUNCH_RDZV_ENDPOINT")
    if endpoint is None and slurm_per_node:  # the step's first node (``scontrol show hostnames``'s first)
        endpoint = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    if endpoint is None:
        raise InvalidOptionError(
            f"nnodes={count} needs a rendezvous endpoint that every node can reach: pass rdzv_endpoint='host:port' "
            "or set MPLAUNCH_RDZV_ENDPOINT."
        )
    if ":" not in endpoint:
        endpoint = f"{endpoint}:{DEFAULT_RDZV_PORT}"
    run_id = env.get("MPLAUNCH_RUN_ID") or (
        f"{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}" if slurm_per_node else "mplaunch"
    )
    return NodeSetup(count, None if rank is None else _whole("node_rank (MPLAUNCH_NODE_RANK)", rank), endpoint, run_id)


def first_host(nodelist: str) -> str:
    """Return the first host of a SLURM host list (``node[01-02,07],gpu1``: ``node01``, zero padding kept)."""
    host = r"(?:[^\[\],]+|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+"
    if not re.fullmatch(rf"{host}(?:,{host})*", nodelist):
        raise InvalidOptionError(
            f"SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) {nodelist!r} is not a SLURM host list such as "
            "'node[01-02,07],gpu1': set MPLAUNCH_RDZV_ENDPOINT=host:port to the first node's address."
        )
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", re.split(r",(?![^\[]*\])", nodelist, maxsplit=1)[0])


def _whole(name: str, value: Any) -> int:
    """Return ``value`` (an option or a variable's text) as an int, or raise InvalidOptionError naming it."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidOptionError(f"{name}={value!r} is not valid: pass a whole number.") from None
