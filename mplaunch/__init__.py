"""Run one function on N worker processes of this machine and get its result back.

Example:
    >>> from mplaunch import parallel
    >>> @parallel(nprocs=2)  # doctest: +SKIP
    ... def train(lr): ...
"""

from mplaunch._api import ParallelFunction, parallel
from mplaunch._config import LaunchOptions, ParallelConfig, StartMethod
from mplaunch._env import RankInfo, outer_launcher, worker_info
from mplaunch._errors import (
    FailureInfo,
    InvalidOptionError,
    LaunchRefusedError,
    LaunchTimeoutError,
    MplaunchError,
    RemoteError,
    RemoteTraceback,
    WorkerExitedError,
    WorkerFailedError,
    failure_info,
)
from mplaunch._parent.checks import record_cuda_init
from mplaunch._parent.restarts import RestartWarning
from mplaunch._spawn_compat import spawn
from mplaunch._state.sharing import unshare
from mplaunch._state.snapshot import GlobalState, register_state, unregister_state

__all__ = [
    "FailureInfo",
    "GlobalState",
    "InvalidOptionError",
    "LaunchOptions",
    "LaunchRefusedError",
    "LaunchTimeoutError",
    "MplaunchError",
    "ParallelConfig",
    "ParallelFunction",
    "RankInfo",
    "RemoteError",
    "RemoteTraceback",
    "RestartWarning",
    "StartMethod",
    "WorkerExitedError",
    "WorkerFailedError",
    "failure_info",
    "outer_launcher",
    "parallel",
    "record_cuda_init",
    "register_state",
    "spawn",
    "unregister_state",
    "unshare",
    "worker_info",
]
__version__ = "0.3.0"
