"""Running the function in this process as one rank: under an outer launcher (torchrun, SLURM, MPI, a
nested call in an mplaunch worker), or as rank 0 of a world of 1 for a debugger (``ParallelFunction.debug``)."""

from __future__ import annotations

import os
from typing import Any

from mplaunch._config import ParallelConfig
from mplaunch._env import apply_environment, check_extra_env, rank_environment, replacing
from mplaunch._parent.checks import check_arguments, check_log_dir
from mplaunch._parent.policy import resolve_backend
from mplaunch._parent.store import rendezvous
from mplaunch._platform.environ import environ_kept
from mplaunch._state.snapshot import derived_seed, seed_all
from mplaunch._worker.process_group import process_group
from mplaunch._worker.rendezvous import follow_own_rendezvous


def run_in_process(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: ParallelConfig) -> Any:
    """Run the function here as this process's rank of an outer launcher's job (reusing its process group)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if config.seed is not None:  # this process is the rank
        seed_all(derived_seed(config.seed, int(os.environ.get("RANK", "0"))))
    with process_group(resolve_backend(config.backend, world_size), int(os.environ.get("LOCAL_RANK", "0"))):
        value = function._mplaunch_target(*args, **kwargs)
    return [value] if config.return_all else value


def run_here(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: ParallelConfig) -> Any:
    """Run ``function`` here as rank 0 of a world of 1, set up as a worker is but for ``devices=``, ``cpu_binding=``."""
    check_arguments(function, args, kwargs)
    check_log_dir(config.log_dir)
    # the function runs in this thread: nobody else could serve the store, so it starts at once
    with rendezvous(lazy=False) as store, environ_kept():
        env = rank_environment(0, 1, store.addr, store.port, agent_store=store.agent_store)
        apply_environment(os.environ, replacing(env))
        if config.env is not None:
            os.environ.update(check_extra_env(config.env(0) if callable(config.env) else config.env, "env(0)"))
        follow_own_rendezvous()
        return run_in_process(function, args, kwargs, config)
