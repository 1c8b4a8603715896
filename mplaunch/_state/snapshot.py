"""Capture the parent's process-global state and restore it in a worker, so the three start methods start alike
(``spawn``/``forkserver`` workers have none of its seeds and flags; ``fork`` reseeds ``random`` in the child)."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import random
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mplaunch._platform import forks
from mplaunch._state.python import PythonState

_HOOKS: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []


def register_state(capture: Callable[[], Any], restore: Callable[[Any], None]) -> None:
    """Add a piece of your own global state to every [`GlobalState`][mplaunch.GlobalState] captured from now on.

    ``capture()`` runs in the parent at each launch; ``restore(value)`` runs in every worker before your
    function, with the captured ``value``. Both must be picklable (module-level functions are) under
    ``spawn`` and ``forkserver``, and so must ``value``. Registering the same pair twice has no effect.

    Args:
        capture: ``() -> value``, called in the parent.
        restore: ``(value) -> None``, called in each worker.

    Example:
        ```python title="Fragment: mylib stands for a library with a global mode"
        import mylib
        register_state(mylib.get_mode, mylib.set_mode)
        ```
    """
    if (capture, restore) not in _HOOKS:
        _HOOKS.append((capture, restore))


def unregister_state(capture: Callable[[], Any], restore: Callable[[Any], None]) -> None:
    """Remove a pair added by [`register_state()`][mplaunch.register_state]; a pair not registered is ignored."""
    if (capture, restore) in _HOOKS:
        _HOOKS.remove((capture, restore))


def _capture_extra() -> tuple[tuple[Callable[[Any], None], Any], ...]:
    """Capture ``(restore, value)`` of every piece added with :func:`register_state`."""
    return tuple((restore, capture()) for capture, restore in _HOOKS)


@dataclasses.dataclass(frozen=True)
class GlobalState:
    """A snapshot of the process-global settings and random states that decide what a worker computes.

    It covers: deterministic algorithms (and warn-only), ``torch.backends.cudnn.benchmark`` and
    ``.deterministic``, the float32 matmul precision, the default dtype, anomaly detection (and its NaN check),
    the RNG states of Python's ``random``, NumPy's global generator (when ``numpy.random`` is imported), torch's
    CPU generator, every CUDA device's generator when CUDA is already initialised (capturing never creates a
    CUDA context), the warning filters, the ``logging`` configuration (loggers and their console, file and null
    handlers), the umask and the resource limits, and whatever was added with
    [`register_state()`][mplaunch.register_state]. It does
    not cover thread counts (set per worker by the launcher), other libraries' state, or generators you created.

    Capturing costs about a hundred microseconds (the torch CPU RNG state is 5 KiB; each configured logger adds
    a few). Restoring calls a setter only where the value differs, so it costs almost nothing when the worker
    already matches (as after ``fork``).

    Example:
        ```python title="Fragment: what a launch does"
        state = GlobalState.capture()  # in the parent
        state.restore()                # in each worker
        ```
    """

    deterministic: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    float32_matmul_precision: str
    default_dtype: torch.dtype
    anomaly_enabled: bool
    anomaly_check_nan: bool
    python_rng: Any
    numpy_rng: Any
    torch_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...] | None
    extra: tuple[tuple[Callable[[Any], None], Any], ...]
    python: PythonState | None
    reseed: int | None = None  # what every rank seeds its generators with instead, see for_launch

    @classmethod
    def capture(cls, *, python: bool = True) -> GlobalState:
        """Capture the calling process's state. Reads only; never initialises CUDA.

        Args:
            python: also capture the Python-level configuration (warning filters, logging, umask, limits);
                mplaunch skips it for ``fork`` workers, which inherit it exactly (``python`` is then ``None``).
        """
        numpy = sys.modules.get("numpy") if "numpy.random" in sys.modules else None  # unused: nothing to carry
        return cls(
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            default_dtype=torch.get_default_dtype(),
            anomaly_enabled=torch.is_anomaly_enabled(),
            anomaly_check_nan=torch.is_anomaly_check_nan_enabled(),
            python_rng=random.getstate(),
            numpy_rng=None if numpy is None else numpy.random.get_state(),
            torch_rng=torch.get_rng_state(),
            cuda_rng=tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None,
            extra=_capture_extra(),
            python=PythonState.capture() if python else None,
        )

    def restore(self) -> None:
        """Make the calling process's state equal to this snapshot; setters run only where values differ.

        CUDA generators are set lazily (applied when CUDA is first initialised here), for the devices this
        process can see.
        """
        if self.python is not None:
            self.python.restore()  # first: the parent's warning filters apply to what follows
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            self.deterministic,
            self.deterministic_warn_only,
        ):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        if torch.get_float32_matmul_precision() != self.float32_matmul_precision:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != (
            self.anomaly_enabled,
            self.anomaly_check_nan,
        ):
            torch.autograd.set_detect_anomaly(self.anomaly_enabled, self.anomaly_check_nan)
        if self.numpy_rng is not None:
            import numpy

            numpy.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            for device, state in enumerate(self.cuda_rng[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)
        ForkState(self.python_rng, self.extra, self.reseed).restore()  # random, register_state's pieces, the reseed


@dataclasses.dataclass(frozen=True)
class ForkState:
    """What a fork does not keep: ``random`` (reseeded) and the :func:`register_state` pieces (a library may reset)."""

    python_rng: Any
    extra: tuple[tuple[Callable[[Any], None], Any], ...]
    reseed: int | None = None

    @classmethod
    def capture(cls) -> ForkState:
        """Capture it in the parent, right before forking."""
        return cls(random.getstate(), _capture_extra())

    def restore(self) -> None:
        """Restore it in the forked worker."""
        random.setstate(self.python_rng)
        for restore, value in self.extra:
            restore(value)
        if self.reseed is not None:
            seed_all(self.reseed)


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (if imported) and torch's (CUDA lazily) with ``seed``."""
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch.manual_seed(seed)


def derived_seed(*parts: object) -> int:
    """Return a 64-bit seed made of ``parts`` (e.g. a seed and a rank), the same in every process."""
    return int.from_bytes(hashlib.blake2b(pickle.dumps(parts), digest_size=8).digest(), "little")


State = TypeVar("State", GlobalState, ForkState)
_left: list[Any] = [None, 0]  # the generators as the last launch left them, and launches started from them since
_counting = forks.new_lock()


def for_launch(state: State) -> State:
    """Return ``state`` for a launch, with a ``reseed`` if the generators are as the last launch left them (so
    a launch from the very same state draws anew): made of them and the count of launches from them."""
    with _counting:
        now = _generators()
        if now == _left[0]:
            _left[1] += 1
            return dataclasses.replace(state, reseed=derived_seed(now, _left[1]))
        _mark()
        _left[:] = [_generators(), 0]
        return state


def _generators() -> bytes:
    """Return the parent's random states (Python, NumPy's global, torch's CPU and initialised CUDA)."""
    numpy = sys.modules["numpy"].random.get_state() if "numpy.random" in sys.modules else None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return pickle.dumps((random.getstate(), numpy, [t.numpy().tobytes() for t in (torch.get_rng_state(), *cuda)]))


def _mark() -> None:
    """Flip a bit no draw reads in each MT19937 state, so that a re-seeding to the state it had is seen: the next
    twist reads only the first word's top bit, and that word was output already (Matsumoto & Nishimura 1998)."""
    version, words, gauss = random.getstate()
    random.setstate((version, (words[0] ^ 1, *words[1:]), gauss))
    if "numpy.random" in sys.modules:
        name, keys, *rest = sys.modules["numpy"].random.get_state()
        keys = keys.copy()
        keys[0] ^= 1
        sys.modules["numpy"].random.set_state((name, keys, *rest))
    state = torch.get_rng_state()
    if state.numel() == 5056:  # CPUGeneratorImplState: the first word at byte 24
        state[24] ^= 1
        torch.set_rng_state(state)
