"""Run one function on N worker processes of this machine and get its result back (see ``mplaunch.parallel``)."""

from mplaunch._api import ParallelFunction, parallel
from mplaunch._config import LaunchOptions, ParallelConfig, StartMethod
from mplaunch._env import RankInfo, outer_launcher, preempted, worker_info
from mplaunch._errors import (
    FailureInfo,
    InvalidOptionError,
    LaunchRefusedError,
    LaunchTimeoutError,
    MplaunchError,
    NodeLostError,
    PreemptedError,
    RemoteError,
    RemoteTraceback,
    StallError,
    WorkerExitedError,
    WorkerFailedError,
    failure_info,
)
from mplaunch._parent.checks import record_cuda_init
from mplaunch._parent.futures import LaunchFuture
from mplaunch._parent.restarts import RestartWarning
from mplaunch._parent.stream import Stream
from mplaunch._parent.warm import Workers
from mplaunch._reports import RankReport, RunReport
from mplaunch._spawn_compat import spawn
from mplaunch._state.sharing import unshare
from mplaunch._state.snapshot import GlobalState, register_state, unregister_state
from mplaunch._worker.heartbeat import heartbeat

__all__ = [
    "FailureInfo",
    "GlobalState",
    "InvalidOptionError",
    "LaunchFuture",
    "LaunchOptions",
    "LaunchRefusedError",
    "LaunchTimeoutError",
    "MplaunchError",
    "NodeLostError",
    "ParallelConfig",
    "ParallelFunction",
    "PreemptedError",
    "RankInfo",
    "RankReport",
    "RemoteError",
    "RemoteTraceback",
    "RestartWarning",
    "RunReport",
    "StallError",
    "StartMethod",
    "Stream",
    "WorkerExitedError",
    "WorkerFailedError",
    "Workers",
    "failure_info",
    "heartbeat",
    "outer_launcher",
    "parallel",
    "preempted",
    "record_cuda_init",
    "register_state",
    "spawn",
    "unregister_state",
    "unshare",
    "worker_info",
]
__version__ = "0.3.0"
