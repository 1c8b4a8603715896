"""Run one function on N worker processes of this machine and get its result back.

Example:
    >>> from mplaunch import parallel
    >>> @parallel(nprocs=2)  # doctest: +SKIP
    ... def train(lr): ...
"""

from mplaunch._api import ParallelFunction, parallel
from mplaunch._config import LaunchConfig, StartMethod
from mplaunch._env import WorkerInfo, outer_launcher, worker_info
from mplaunch._errors import (
    InvalidOptionError,
    LaunchRefusedError,
    LaunchTimeoutError,
    MplaunchError,
    RemoteError,
    RemoteTraceback,
    WorkerExitedError,
    WorkerFailedError,
)
from mplaunch._parent.checks import record_cuda_init
from mplaunch._parent.restarts import RestartWarning
from mplaunch._state.sharing import to_cpu, unshare
from mplaunch._state.snapshot import GlobalState, register_state, unregister_state

__all__ = [
    "GlobalState",
    "InvalidOptionError",
    "LaunchConfig",
    "LaunchRefusedError",
    "LaunchTimeoutError",
    "MplaunchError",
    "ParallelFunction",
    "RemoteError",
    "RemoteTraceback",
    "RestartWarning",
    "StartMethod",
    "WorkerExitedError",
    "WorkerFailedError",
    "WorkerInfo",
    "outer_launcher",
    "parallel",
    "record_cuda_init",
    "register_state",
    "to_cpu",
    "unregister_state",
    "unshare",
    "worker_info",
]
__version__ = "0.1.0"
