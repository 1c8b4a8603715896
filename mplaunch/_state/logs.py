"""Capture the parent's ``logging`` configuration and rebuild it in a ``spawn``/``forkserver`` worker: console,
file (appended to, never truncated) and null handlers; the snapshot names the others for one warning."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import sys
import warnings
import weakref
from typing import Any

_STD_STREAMS = ("stdout", "stderr")
_FORMATTERS: weakref.WeakKeyDictionary[logging.Formatter, tuple[Any, bytes]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class HandlerSpec:
    """How to rebuild one handler (``kind``: stdout, stderr, file, null, or "not carried": a match is left alone)."""

    key: int = dataclasses.field(compare=False)  # first position in the snapshot: a shared handler is built once
    kind: str
    name: str | None
    level: int
    formatter: bytes | None
    filters: bytes | None
    path: str = ""  # the file, or what was not carried
    mode: str = "a"
    encoding: str | None = None
    errors: str | None = None
    delay: bool = False


@dataclasses.dataclass(frozen=True)
class LoggerSpec:
    """One logger that is not in its default state; ``name`` is ``None`` for the root logger."""

    name: str | None
    level: int
    propagate: bool
    disabled: bool
    filters: bytes | None
    handlers: tuple[HandlerSpec, ...]


@dataclasses.dataclass(frozen=True)
class LoggingState:
    """The configured loggers, ``logging.disable``, ``captureWarnings``, and what was not carried."""

    loggers: tuple[LoggerSpec, ...]
    disable: int
    capture_warnings: bool
    not_carried: tuple[str, ...] = dataclasses.field(compare=False, default=())

    @classmethod
    def capture(cls) -> LoggingState:
        """Describe this process's logging configuration. Reads only."""
        keys: dict[int, int] = {}
        not_carried: dict[str, list[str]] = {}  # what, on which loggers
        loggers = []
        for name, logger in [(None, logging.root), *list(logging.Logger.manager.loggerDict.items())]:
            if not isinstance(logger, logging.Logger):  # a PlaceHolder
                continue
            if name is not None and (_is_default(logger) or name.split(".")[0] in _KERNEL_LOGGERS):
                continue
            label = "the root logger" if name is None else f"logger {name!r}"
            handlers = tuple(_describe(handler, keys, label, not_carried) for handler in list(logger.handlers))
            missing: list[str] = []
            filters = _pickled(logger.filters, f"the filters of {label}", missing)
            not_carried.update((item, []) for item in missing)
            loggers.append(LoggerSpec(name, logger.level, logger.propagate, logger.disabled, filters, handlers))
        return cls(
            loggers=tuple(loggers),
            disable=logging.root.manager.disable,
            capture_warnings=warnings.showwarning is getattr(logging, "_showwarning", None),
            not_carried=tuple(_where(what, labels) for what, labels in not_carried.items()),
        )

    def restore(self) -> None:
        """Make this process's configuration equal to the snapshot; leave out a handler not carried or not rebuilt."""
        if LoggingState.capture() == self:
            return
        built: dict[int, logging.Handler | None] = {}
        for spec in self.loggers:
            logger = logging.root if spec.name is None else logging.getLogger(spec.name)
            if logger.level != spec.level:
                logger.setLevel(spec.level)
            logger.propagate, logger.disabled = spec.propagate, spec.disabled
            logger.filters = _loaded(spec.filters, [])
            current = [(_describe(handler, {}, "", {}), handler) for handler in logger.handlers]
            if tuple(described for described, _ in current) == spec.handlers:
                continue
            for _, handler in current:
                logger.removeHandler(handler)
            for handler_spec in spec.handlers:  # one this process already has (e.g. set up by an import) is kept
                if handler_spec.key not in built:
                    same = (handler for described, handler in current if described == handler_spec)
                    built[handler_spec.key] = next(same, None) or _build(handler_spec)
                new = built[handler_spec.key]
                if new is not None:
                    logger.addHandler(new)
        if logging.root.manager.disable != self.disable:
            logging.disable(self.disable)
        if self.capture_warnings != (warnings.showwarning is getattr(logging, "_showwarning", None)):
            logging.captureWarnings(self.capture_warnings)


# A Jupyter kernel's own loggers: no rank needs them; neither carried nor warned about.
_KERNEL_LOGGERS = ("IPKernelApp", "ipykernel", "traitlets", "jupyter_client", "tornado")


def _where(what: str, labels: list[str]) -> str:
    if not labels:
        return what
    more = f" and {len(labels) - 1} other loggers" if len(labels) > 1 else ""
    return f"{what} on {labels[0]}{more}"


def _is_default(logger: logging.Logger) -> bool:
    return (
        logger.level == logging.NOTSET
        and not logger.handlers
        and logger.propagate
        and not logger.disabled
        and not logger.filters
    )


def _pickled(objects: Any, what: str, not_carried: list[str]) -> bytes | None:
    if not objects:
        return None
    try:
        return pickle.dumps(objects)
    except Exception as error:  # noqa: BLE001 - whatever pickling raises, it is not carried
        not_carried.append(f"{what} ({type(error).__name__}: {error})")
        return None


def _pickled_formatter(formatter: logging.Formatter | None, not_carried: list[str]) -> bytes | None:
    """Pickle ``formatter``, cached while its attributes stay (torch configures dozens; capture runs per launch)."""
    if formatter is None:
        return None
    cached = _FORMATTERS.get(formatter)
    state = dict(vars(formatter)), dict(vars(getattr(formatter, "_style", None) or formatter))
    if cached is not None and cached[0] == state:
        return cached[1]
    data = _pickled(formatter, "", not_carried)
    if data is not None:
        _FORMATTERS[formatter] = (state, data)
    return data


def _loaded(data: bytes | None, default: Any) -> Any:
    if data is None:
        return default
    try:
        return pickle.loads(data)
    except Exception as error:  # noqa: BLE001 - e.g. a class this worker cannot import
        _note(f"could not rebuild a logging formatter or filter in this worker ({type(error).__name__}: {error})")
        return default


def _stream_name(stream: Any) -> str | None:
    for name in _STD_STREAMS:
        if stream is getattr(sys, name) or stream is getattr(sys, f"__{name}__"):
            return name
    return None


def _is_plain_null(handler: logging.Handler) -> bool:
    kind = type(handler)
    return (
        isinstance(handler, logging.NullHandler)
        and kind.emit is logging.NullHandler.emit
        and kind.handle is logging.NullHandler.handle
    )


def _describe(
    handler: logging.Handler, keys: dict[int, int], label: str, not_carried: dict[str, list[str]]
) -> HandlerSpec:
    """Describe ``handler``; if not carried, add ``label`` (its logger) to ``not_carried[description]``."""
    key = keys.setdefault(id(handler), len(keys))
    kind, path = "not carried", f"{type(handler).__module__}.{type(handler).__qualname__}"
    extra: dict[str, Any] = {}
    if type(handler) is logging.StreamHandler:
        stream = _stream_name(handler.stream)
        if stream is not None:
            kind = stream
        else:
            path += f" to {handler.stream!r}"
    elif type(handler) is logging.FileHandler:
        mode = handler.mode.replace("w", "a", 1).replace("x", "a", 1)  # append: never truncate the parent's log
        kind, path = "file", handler.baseFilename
        extra = {"mode": mode, "encoding": handler.encoding, "errors": handler.errors, "delay": handler.delay}
    elif _is_plain_null(handler):
        kind = "null"
    formatter = filters = None
    if kind not in ("not carried", "null"):  # a NullHandler formats and filters nothing
        missing: list[str] = []
        formatter = _pickled_formatter(handler.formatter, missing)
        filters = _pickled(handler.filters, "", missing)
        if missing:
            kind, path = "not carried", f"{path} (its formatter or filters cannot be pickled)"
    own = type(handler).__module__.partition(".")[0] == "torch"  # torch sets these up in every process itself
    if kind == "not carried" and not own:
        labels = not_carried.setdefault(path, [])
        if label not in labels:
            labels.append(label)
    return HandlerSpec(key, kind, handler.get_name(), handler.level, formatter, filters, path, **extra)


def _build(spec: HandlerSpec) -> logging.Handler | None:
    """Build a handler from ``spec``; ``None`` when it was not carried or cannot be rebuilt here."""
    handler: logging.Handler
    if spec.kind in _STD_STREAMS:
        handler = logging.StreamHandler(getattr(sys, spec.kind))
    elif spec.kind == "null":
        handler = logging.NullHandler()
    elif spec.kind == "file":
        try:
            handler = logging.FileHandler(spec.path, spec.mode, spec.encoding, spec.delay, spec.errors)
        except OSError as error:
            _note(f"could not open the log file {spec.path!r} in this worker: {error}")
            return None
    else:
        return None
    if spec.name is not None:
        handler.set_name(spec.name)
    handler.setLevel(spec.level)
    handler.setFormatter(_loaded(spec.formatter, None))
    handler.filters = _loaded(spec.filters, [])
    return handler


def _note(message: str) -> None:
    """Tell the user on stderr (not a warning: the carried filters may make it an error)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"mplaunch: {message}", file=sys.stderr, flush=True)
