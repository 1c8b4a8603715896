"""What the parent makes for each rank right before forking it: a page a forked worker writes is first copied, so
set-up done once in the parent saves each rank its copies."""

from __future__ import annotations

from typing import TextIO

from mplaunch._platform.environ import ForkEnviron, c_getenv, fork_environs
from mplaunch._wire import flags
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker import apply_placement as placement
from mplaunch._worker.debugger import breakpoint_plan
from mplaunch._worker.exit import inherited_logging
from mplaunch._worker.process_group import has_groups
from mplaunch._worker.setup import Forked, rank_changes

_RANK_OWN = ("RANK", "LOCAL_RANK", "ROLE_RANK")  # the variables of rank_changes() that are the rank's own


def prepare_forks(spec: WorkerSpec, stdin: TextIO | None) -> list[Forked]:
    """Make each rank's :class:`Forked`; ``stdin``: every rank's ``sys.stdin`` (the caller closes its copy)."""
    logging, groups, flag = inherited_logging(), has_groups(), flags.path_if_present(spec.launch.directory)
    shared = rank_changes(spec, 0)  # torchrun's variables but the rank's own, and the flag's path
    for name in _RANK_OWN:
        del shared[name]
    if flag is not None:
        shared[flags.FLAG_VARIABLE] = flag
    own = [_rank_fork_changes(spec, rank) for rank in range(spec.launch.nprocs)]
    made = fork_environs(shared, own)
    environs: list[ForkEnviron | None] = [None] * spec.launch.nprocs if made is None else [*made]
    usual = breakpoint_plan(c_getenv("PYTHONBREAKPOINT"))  # (CPython's breakpoint() reads the C table)
    plans = [usual if "PYTHONBREAKPOINT" not in env else breakpoint_plan(env["PYTHONBREAKPOINT"]) for env in own]
    return [Forked(environs[rank], stdin, logging, groups, flag is not None, plans[rank]) for rank in range(len(own))]


def _rank_fork_changes(spec: WorkerSpec, rank: int) -> dict[str, str | None]:
    """Return ``rank``'s own environment changes: its rank variables, placement and ``OMP_NUM_THREADS``."""
    changes: dict[str, str | None] = {name: str(rank) for name in _RANK_OWN}
    extra = placement.environment(spec, rank)
    changes.update(extra)
    changes["OMP_NUM_THREADS"] = str(placement.planned_threads(spec, rank, placement.threads_in(extra)))
    return changes
