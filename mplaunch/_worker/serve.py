"""What a warm worker (:class:`mplaunch.Workers`) runs: set up the rank and process group once, then serve calls.

Each ``CALL`` is read from the launch directory, run in the main thread, answered with its outcome and ``DONE``.
SIGINT interrupts a running call (the parent sends ``CANCEL`` first, so one not started is skipped) and is
ignored between calls; SIGTERM ends the worker.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import os
import sys
import time
import types
from multiprocessing.connection import Connection
from typing import Any

from mplaunch._wire import flags, transport
from mplaunch._wire.records import (
    CALL,
    CANCEL,
    DONE,
    EXIT,
    READY,
    Call,
    Outcome,
    Payload,
    Raised,
    Returned,
    call_name,
    result_name,
)
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker import entry
from mplaunch._worker.debugger import post_mortem
from mplaunch._worker.heartbeat import watch
from mplaunch._worker.outcome import finish, stops_held, write_outcome
from mplaunch._worker.process_group import clash, process_group
from mplaunch._worker.setup import Forked, set_up
from mplaunch._worker.state import state

_in_call = False  # SIGINT raises KeyboardInterrupt only while a call runs
_takes_ctrl_c = True  # the call runs in the caller's main thread: a Ctrl-C to the caller's group stops it
_current: tuple[Connection, int] | None = None  # the pipe and number of the call that runs


class _Cancelled(KeyboardInterrupt):
    """The parent no longer wanted the call before it started."""


def _on_interrupt(signum: int, frame: object) -> None:
    """Interrupt the running call if the parent cancelled it or it takes a Ctrl-C (a submitted call does not)."""
    if _in_call and (_takes_ctrl_c or (_current is not None and _current[0].poll(0) and _cancelled(*_current))):
        raise KeyboardInterrupt()


def serve(rank: int, spec: WorkerSpec, payload: Payload | None, forked: Forked | None, conn: Connection) -> None:
    """Set up the rank, serve calls from ``conn`` until told to leave, exit: every warm worker's target."""
    outcome: Outcome | None = None
    try:
        set_up(rank, spec, _on_interrupt, forked)  # a SIGINT while starting must not end the rank
        watch(spec, rank)  # stacks on request, heartbeats, NCCL's flight recorder
        flags.attach(spec.launch.directory, None if forked is None else forked.flag)  # for mplaunch.preempted()
        entry.restore(rank, rank, spec, payload)
        del payload
        with process_group(spec.launch.backend, rank):
            conn.send((READY,))  # a call's timeout counts from here: the start is not the call's
            _loop(rank, spec, conn)
        outcome = Returned(os.getpid(), None)
    except BaseException as error:  # noqa: BLE001 - a stop (SIGTERM) is reported by finish
        if state.signal_received is None:
            finish(spec, rank, Raised.of(error))  # the set-up failed: the parent raises why
    conn.close()
    finish(spec, rank, outcome, written=outcome is not None)


def _loop(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """Serve calls until ``EXIT`` or the end of the pipe."""
    while True:
        try:
            message = _early.pop(0) if _early else conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == EXIT:
            return
        if message[0] == CALL:
            _serve_call(rank, spec, conn, *message[1:])
        # a CANCEL of a call already done is stale: ignored


_early: list[tuple[Any, ...]] = []  # a message read ahead while looking for a CANCEL (an EXIT)


def _serve_call(
    rank: int, spec: WorkerSpec, conn: Connection, number: int, takes_ctrl_c: bool, report_all: bool
) -> None:
    """Run call ``number``, write its outcome (the value where this rank reports), and say so."""
    reporting = report_all or rank in spec.launch.reporting_ranks
    global _in_call, _takes_ctrl_c, _current
    _takes_ctrl_c, _current = takes_ctrl_c, (conn, number)
    raised_at = None
    try:
        try:
            _in_call = True
            if conn.poll(0) and _cancelled(conn, number):  # a SIGINT may have come before _in_call was set
                raise _Cancelled()
            call: Call = transport.load(spec.launch.directory, call_name(number), private=True, remove=False)
            function = _in_main(call.function, call.filename)
            value = function(*call.args, **call.kwargs)
            del call
            if inspect.isgenerator(value):
                value = entry.stream_values(value, rank, reporting, spec, conn, number)
            _in_call = False
        except BaseException:
            _in_call = False
            raised_at = time.monotonic()
            raise
        outcome: Outcome = Returned(os.getpid(), value if reporting else None)
        del value
    except BaseException as error:  # noqa: BLE001 - every failure of the call is its outcome
        if state.signal_received is not None:
            raise  # SIGTERM: the worker ends
        if spec.launch.post_mortem:
            post_mortem(error, spec, rank)
        with stops_held():
            outcome = Raised.of(clash(error, spec.launch.backend) or error, when=raised_at)
        del error
    if os.getpid() != state.pid:  # a process the function forked, returning: not the worker
        os._exit(0 if isinstance(outcome, Returned) else 1)
    for stream in (sys.stdout, sys.stderr):  # the call's output reaches the parent before its outcome
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    write_outcome(spec, rank, outcome, result_name(number, rank))
    del outcome
    conn.send((DONE, number))


def _cancelled(conn: Connection, number: int) -> bool:
    """Return whether the waiting message cancels call ``number``: its CANCEL, or an EXIT (workers closing)."""
    with entry.whole_messages():
        message = conn.recv()
    if message[0] == CANCEL:
        return bool(message[1] == number)
    _early.append(message)
    return bool(message[0] == EXIT)


def _in_main(function: Any, filename: str | None) -> Any:
    """Return the function to call; one of ``__main__`` sent by value runs in this worker's ``__main__``, so
    globals persist between calls. Its globals are copied there, except those a function run here assigns."""
    function = getattr(function, "_mplaunch_target", function)
    if isinstance(function, types.FunctionType) and filename and function.__code__.co_filename != filename:
        function.__code__ = _in_file(function.__code__, filename)
    main = sys.modules.get("__main__")
    if not isinstance(function, types.FunctionType) or function.__module__ != "__main__" or main is None:
        return function
    namespace = vars(main)
    if function.__globals__ is namespace:
        return function
    for name, value in function.__globals__.items():
        if not name.startswith("__") and name not in _rank_globals:
            namespace[name] = value
    _rank_globals.update(_assigned_globals(function.__code__))
    rebound = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__dict__.update(function.__dict__)
    return rebound


_rank_globals: set[str] = set()  # the globals of __main__ that functions run here assign


def _assigned_globals(code: types.CodeType) -> set[str]:
    """Return the global names that ``code`` and its nested code assign or delete."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _assigned_globals(constant)
    return names


def _in_file(code: types.CodeType, filename: str) -> types.CodeType:
    """Return ``code`` and its nested code as defined in ``filename``."""
    consts = tuple(_in_file(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)
