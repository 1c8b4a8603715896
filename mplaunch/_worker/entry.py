"""What a launch's worker runs: set up as the rank, restore the parent's state, run the function with private
arguments (a generator's values sent as they come), and end with its outcome."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import time
import warnings
from collections.abc import Generator, Iterator
from multiprocessing.connection import Connection
from typing import Any

from mplaunch._platform.csignal import pthread_sigmask
from mplaunch._state.snapshot import derived_seed, seed_all
from mplaunch._wire import flags, transport
from mplaunch._wire.inherited import close_quietly
from mplaunch._wire.records import ITEM, PAYLOAD, Outcome, Payload, Raised, Returned, item_name
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker import apply_placement as placement
from mplaunch._worker.debugger import post_mortem
from mplaunch._worker.heartbeat import watch
from mplaunch._worker.outcome import decide, finish, unsendable
from mplaunch._worker.process_group import process_group
from mplaunch._worker.setup import Forked, Interrupted, Terminated, set_threads, set_up
from mplaunch._worker.state import state


def execute(
    rank: int, local_rank: int, spec: WorkerSpec, payload: Payload | None, conn: Connection | None = None
) -> Outcome:
    """Restore the parent's state, run the function, and return the outcome; with ``conn``, stream a generator."""
    try:
        payload = restore(rank, local_rank, spec, payload)
        function = getattr(payload.function, "_mplaunch_target", payload.function)
        with process_group(spec.launch.backend, local_rank):
            try:
                value = function(*payload.args, **payload.kwargs)
                if conn is not None and inspect.isgenerator(value):
                    value = stream_values(value, rank, rank in spec.launch.reporting_ranks, spec, conn, 0)
            except BaseException as error:  # when: before the process group's teardown makes peers fail too
                state.raised = (error, time.monotonic())
                raise
        return decide(Returned(os.getpid(), value if rank in spec.launch.reporting_ranks else None))
    except BaseException as error:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        if state.raised is not None and isinstance(error, (Terminated, Interrupted)):
            error = state.raised[0]  # the stop landed while the process group was torn down: the function's error first
        if spec.launch.post_mortem and state.signal_received is None:
            post_mortem(error, spec, rank)
        # a stop while the error is pickled is noted, not raised (the record keeps its type); decide weighs it
        state.outcome_decided = True
        return decide(Raised.of(error, when=None if state.raised is None else state.raised[1]))


def restore(rank: int, local_rank: int, spec: WorkerSpec, payload: Payload | None) -> Payload:
    """Apply the rank's placement, then restore the parent's state from ``payload`` (else read here)."""
    variables = placement.apply(spec, local_rank, rank, environ_made=state.environ_made)  # before anything reads them
    set_threads(placement.thread_count(spec, local_rank))
    if payload is None:
        payload = read_payload(spec)
    payload.state.restore()
    if "PYTHONWARNINGS" in variables:  # over the parent's filters, as Python puts them over its defaults
        getattr(warnings, "_processoptions", lambda options: None)(variables["PYTHONWARNINGS"].split(","))
    if spec.launch.seed is not None:
        seed_all(derived_seed(spec.launch.seed, rank))
    return payload


def read_payload(spec: WorkerSpec) -> Payload:
    """Load the call, mapped copy-on-write from the parent's memory file or the launch directory."""
    if spec.launch.payload_fd is None:
        payload: Payload = transport.load(
            spec.launch.directory, PAYLOAD, private=True, remove=False, start_objects=spec.launch.start_objects
        )
        return payload
    try:
        payload = transport.load_fd(spec.launch.payload_fd.fd, result=False, start_objects=spec.launch.start_objects)
        return payload
    finally:
        close_quietly(spec.launch.payload_fd.fd)  # the mappings keep what they need


def run(
    rank: int, spec: WorkerSpec, payload: Payload | None, forked: Forked | None = None, conn: Connection | None = None
) -> None:
    """Set up the rank, run the function, write the outcome, exit: every launch worker's target."""
    outcome: Outcome | None = None
    try:
        set_up(rank, spec, forked=forked)
        watch(spec, rank)  # stacks on request, heartbeats, NCCL's flight recorder
        flags.attach(spec.launch.directory, None if forked is None else forked.flag)  # for mplaunch.preempted()
        outcome = execute(rank, rank, spec, payload, conn)
    except BaseException as error:  # noqa: BLE001 - a stop that landed while starting is reported by finish
        if state.signal_received is None:
            outcome = Raised.of(error)  # the set-up failed: the parent raises why
    finish(spec, rank, outcome)


def stream_values(
    generator: Generator[Any, Any, Any], rank: int, reporting: bool, spec: WorkerSpec, conn: Connection, number: int
) -> Any:
    """Send each value ``generator`` yields as a file announced with ``ITEM`` on ``conn``; return its value."""
    index = 0
    try:
        while True:
            try:
                item = next(generator)
            except StopIteration as stop:
                return stop.value
            if reporting:
                try:
                    transport.dump(item, spec.launch.directory, item_name(number, rank, index))
                except Exception as error:  # noqa: BLE001 - reported as an unsendable result is
                    what = f"the value #{index} that rank {rank} yielded"
                    raise unsendable(what, "value", item, error, rank, True) from error
                with whole_messages():
                    conn.send((ITEM, number, index))
                index += 1
            del item
    finally:
        generator.close()


@contextlib.contextmanager
def whole_messages() -> Iterator[None]:
    """Hold SIGINT while a pipe message is read or written: a ``KeyboardInterrupt`` mid-message desyncs the pipe."""
    previous = pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT,))
    try:
        yield
    finally:
        pthread_sigmask(signal.SIG_SETMASK, previous)
