"""The global-state snapshot, in one process."""

from __future__ import annotations

import io
import logging
import os
import random
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest
import torch

from mplaunch import GlobalState, register_state, unregister_state
from mplaunch._state.python import PythonState


@pytest.fixture
def restored_state() -> Iterator[None]:
    """Put back the process's state after a test that changes it (and the variable that torch's first
    use_deterministic_algorithms() call sets when it imports inductor)."""
    state = GlobalState.capture()
    environ = dict(os.environ)
    yield
    state.restore()
    os.environ.clear()
    os.environ.update(environ)


def test_restore_brings_back_settings_and_random_streams(restored_state: None) -> None:
    random.seed(1)
    numpy.random.seed(1)
    torch.manual_seed(1)
    state = GlobalState.capture()
    expected = (random.random(), numpy.random.rand(), torch.rand(2))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.set_default_dtype(torch.float64)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.autograd.set_detect_anomaly(True)
    random.seed(2)
    numpy.random.seed(2)
    torch.manual_seed(2)
    state.restore()
    assert torch.are_deterministic_algorithms_enabled() is state.deterministic
    assert torch.get_float32_matmul_precision() == state.float32_matmul_precision
    assert torch.get_default_dtype() == state.default_dtype
    assert torch.backends.cudnn.benchmark is state.cudnn_benchmark
    assert torch.is_anomaly_enabled() is state.anomaly_enabled
    again = (random.random(), numpy.random.rand(), torch.rand(2))
    assert again[0] == expected[0]
    assert again[1] == expected[1]
    assert torch.equal(again[2], expected[2])


def test_restore_calls_no_setter_when_nothing_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    state = GlobalState.capture()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("setter called although the value already matched")

    for name in ("use_deterministic_algorithms", "set_float32_matmul_precision", "set_default_dtype"):
        monkeypatch.setattr(torch, name, forbidden)
    monkeypatch.setattr(torch.autograd, "set_detect_anomaly", forbidden)
    state.restore()


def test_capture_never_initialises_cuda() -> None:
    state = GlobalState.capture()
    assert state.cuda_rng is None or torch.cuda.is_initialized()
    assert not torch.cuda.is_initialized() or torch.cuda.is_available()


_custom: dict[str, int] = {"mode": 0}


def _capture_custom() -> int:
    return _custom["mode"]


def _restore_custom(value: int) -> None:
    _custom["mode"] = value


def test_registered_state_travels_with_the_snapshot() -> None:
    register_state(_capture_custom, _restore_custom)
    register_state(_capture_custom, _restore_custom)  # twice is once
    try:
        _custom["mode"] = 3
        state = GlobalState.capture()
        assert len(state.extra) == 1
        _custom["mode"] = 0
        state.restore()
        assert _custom["mode"] == 3
    finally:
        unregister_state(_capture_custom, _restore_custom)
    assert GlobalState.capture().extra == ()


@pytest.fixture
def test_logger(tmp_path: Path) -> Iterator[logging.Logger]:
    """A logger of the test's own, reset afterwards (handlers closed)."""
    logger = logging.getLogger("mplaunch_unit_state")
    yield logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.NOTSET)
    logger.propagate, logger.disabled = True, False


def _configure(logger: logging.Logger, path: Path) -> list[logging.Handler]:
    handlers: list[logging.Handler] = [
        logging.FileHandler(path, mode="w", encoding="utf-8"),
        logging.StreamHandler(sys.stderr),
    ]
    for handler in handlers:
        handler.setFormatter(logging.Formatter("{levelname}|{message}", datefmt="%H:%M", style="{"))
        handler.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handlers


def test_logging_and_warning_filters_are_rebuilt_as_configured(test_logger: logging.Logger, tmp_path: Path) -> None:
    path = tmp_path / "parent.log"
    _configure(test_logger, path)
    test_logger.info("parent line")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="unit-state-filter", category=UserWarning)
        state = PythonState.capture()
        warnings.resetwarnings()
        for handler in list(test_logger.handlers):
            test_logger.removeHandler(handler)
            handler.close()
        test_logger.setLevel(logging.NOTSET)
        test_logger.propagate = True
        state.restore()  # as in a spawn worker: nothing configured yet
        message = warnings.filters[0][1]
        assert message is not None
        assert message.pattern == "unit-state-filter"
    assert (test_logger.level, test_logger.propagate) == (logging.INFO, False)
    file, stream = test_logger.handlers
    assert isinstance(file, logging.FileHandler)
    assert file.baseFilename == str(path)
    assert file.mode == "a"
    assert type(stream) is logging.StreamHandler
    assert stream.stream is sys.stderr
    for handler in (file, stream):
        assert handler.level == logging.DEBUG
        assert handler.formatter is not None
        assert (handler.formatter._fmt, handler.formatter.datefmt) == ("{levelname}|{message}", "%H:%M")
        assert isinstance(handler.formatter._style, logging.StrFormatStyle)
    test_logger.info("worker line")
    file.flush()
    assert path.read_text(encoding="utf-8").splitlines() == ["INFO|parent line", "INFO|worker line"]  # appended


def test_restore_keeps_handlers_that_already_match(test_logger: logging.Logger, tmp_path: Path) -> None:
    handlers = _configure(test_logger, tmp_path / "log.txt")
    state = PythonState.capture()
    state.restore()  # as after fork: the same objects, no duplicate handler
    assert test_logger.handlers == handlers


def test_handlers_that_cannot_be_carried_are_named_once_at_the_callers_line(test_logger: logging.Logger) -> None:
    import logging.handlers

    from mplaunch._state.python import warn_not_carried

    test_logger.addHandler(logging.handlers.SocketHandler("127.0.0.1", 9))  # never connects until it emits
    test_logger.addHandler(logging.StreamHandler(io.StringIO()))
    state = PythonState.capture()
    assert any("SocketHandler on logger 'mplaunch_unit_state'" in item for item in state.not_carried)
    assert any("StreamHandler to <_io.StringIO" in item for item in state.not_carried)
    with pytest.warns(RuntimeWarning, match="SocketHandler") as record:
        warn_not_carried(state)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_not_carried(PythonState.capture())  # once per process
    state.restore()  # never a crash; the uncarried handlers are left alone where they already are
    assert len(test_logger.handlers) == 2


def test_exit_closes_the_files_left_open_wrappers_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import gzip

    from mplaunch._worker import exit

    text = open(tmp_path / "rows.txt", "a", encoding="utf-8")  # noqa: SIM115
    text.write("row\n")
    raw = open(tmp_path / "data.gz", "wb")  # noqa: SIM115
    packed = gzip.GzipFile(fileobj=raw, mode="wb")
    packed.write(b"payload")
    buffer = text.buffer
    assert isinstance(buffer, io.BufferedWriter)  # typeshed's TextIOWrapper.buffer is a protocol without .raw
    found = [raw, raw.raw, buffer.raw, buffer, sys.stderr, text, io.BytesIO(), packed]  # as gc lists them
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # the test process's handlers are pytest's
    monkeypatch.setattr(gc, "get_objects", lambda: found)  # the test process's other files are pytest's
    exit.close_files()
    assert text.closed
    assert packed.closed
    assert raw.closed
    assert not sys.stderr.closed
    assert (tmp_path / "rows.txt").read_text(encoding="utf-8") == "row\n"
    assert gzip.decompress((tmp_path / "data.gz").read_bytes()) == b"payload"  # closed before its file


def test_rebuilding_keeps_handlers_this_process_already_has(test_logger: logging.Logger) -> None:
    import logging.handlers

    own = logging.handlers.SocketHandler("127.0.0.1", 9)  # as a worker's import may add: cannot be carried
    test_logger.addHandler(own)
    test_logger.addHandler(logging.StreamHandler(sys.stdout))
    state = PythonState.capture()
    test_logger.removeHandler(test_logger.handlers[1])  # the worker lacks the console handler
    state.restore()
    first, second = test_logger.handlers
    assert first is own
    assert type(second) is logging.StreamHandler
    assert second.stream is sys.stdout


def test_a_real_call_warns_at_the_callers_line(test_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging.handlers
    import threading

    from mplaunch import LaunchRefusedError, parallel
    from mplaunch._state import python

    monkeypatch.setattr(python, "_warned", set())
    test_logger.addHandler(logging.handlers.SocketHandler("127.0.0.1", 9))
    run = parallel(nprocs=2, start_method="spawn", timeout=30)(print)
    with pytest.warns(RuntimeWarning, match="SocketHandler") as record, pytest.raises(LaunchRefusedError):
        run(threading.Lock())  # refused before any worker starts: cannot be pickled
    assert record[0].filename == __file__


def test_spawn_workers_get_one_hash_seed_unless_the_user_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch._parent.processes import spawn_environ

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seeds = []
    for _ in range(2):
        with spawn_environ("spawn", {}):
            seeds.append(os.environ["PYTHONHASHSEED"])
        assert "PYTHONHASHSEED" not in os.environ  # the parent's environment as found
    assert seeds[0] == seeds[1]
    assert 0 < int(seeds[0]) < 2**32  # the same for every launch of this process
    with spawn_environ("fork", {"MPLAUNCH_TEST": "1"}):
        assert "PYTHONHASHSEED" not in os.environ and "MPLAUNCH_TEST" not in os.environ  # fork: set in the rank
    for users in ("7", "random"):
        monkeypatch.setenv("PYTHONHASHSEED", users)
        with spawn_environ("spawn", {}):
            assert os.environ["PYTHONHASHSEED"] == (users if users != "random" else seeds[0])
        assert os.environ["PYTHONHASHSEED"] == users
    with spawn_environ("spawn", {"PYTHONHASHSEED": "3", "MPLAUNCH_TEST": "1"}):  # a rank's env= goes first
        assert (os.environ["PYTHONHASHSEED"], os.environ["MPLAUNCH_TEST"]) == ("3", "1")
    assert "MPLAUNCH_TEST" not in os.environ


@pytest.mark.parametrize("drawn", [0, 1, 700], ids=["seeded", "drawn-once", "past-a-twist"])
def test_a_launch_marks_the_generators_without_changing_their_numbers(restored_state: None, drawn: int) -> None:
    """for_launch flips, in each generator it finds changed, a bit of its MT19937 state that no draw reads, so
    that a launch from the state the previous one left is told from one after seeding again to the same seed
    (issue 37). The parent's own numbers must not change: Python's, NumPy's legacy and torch's CPU generator
    (whose state layout this checks), fresh from a seed or drawn from, for uniform and normal draws."""
    from mplaunch._state import snapshot

    def draws() -> list[float]:
        state = GlobalState.capture()
        try:
            found = [random.random() for _ in range(700)] + [random.gauss(0, 1) for _ in range(3)]
            found += [*numpy.random.rand(700), *numpy.random.randn(3)]
            return found + torch.rand(700).tolist() + torch.randn(3).tolist() + torch.randperm(20).tolist()
        finally:
            state.restore()

    random.seed(3)
    numpy.random.seed(3)
    torch.manual_seed(3)
    for _ in range(drawn):
        random.random(), numpy.random.rand(), torch.rand(1)
    before, state = draws(), GlobalState.capture()
    assert snapshot.for_launch(state) is state  # a new state: taken as it is, and marked
    assert draws() == before
    assert random.getstate() != state.python_rng and not torch.equal(torch.get_rng_state(), state.torch_rng)
    again = snapshot.for_launch(state)  # nothing changed since: the ranks seed anew
    assert again.reseed is not None and snapshot.for_launch(state).reseed not in (None, again.reseed)
    torch.manual_seed(3)  # seeded again (to the same state, had nothing been drawn): taken as it is
    assert snapshot.for_launch(state) is state
