"""Module-level worker functions for tests/integration/test_inheritance.py (importable by spawn/forkserver
workers; kept apart from tests/workers.py so the inheritance tests own their helpers)."""

from __future__ import annotations

import logging
import os
import random
import resource
import sys
import warnings
from typing import Any, TextIO

import torch

from mplaunch import worker_info

_ROWS: TextIO | None = None  # opened by the worker on first use and never closed, as a program's module global


def append_row(path: str) -> None:
    """Append this rank's row to a file kept open in a module global; never flushed or closed."""
    global _ROWS
    _ROWS = _ROWS or open(path, "a")  # noqa: SIM115 - left open on purpose
    _ROWS.write(f"row from rank {worker_info().rank}\n")


def observe(rows_path: str, logger_name: str) -> dict[str, Any]:
    """Everything the inheritance table promises, as this worker sees it; also logs and appends a row."""
    append_row(rows_path)
    logging.getLogger(f"{logger_name}.child").info("logged by rank %d", worker_info().rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("mplaunch-inheritance-ignored", UserWarning, stacklevel=1)
    logger = logging.getLogger(logger_name)
    umask = os.umask(0)
    os.umask(umask)
    return {
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "env": os.environ.get("MPLAUNCH_INHERITANCE_MARK"),
        "hash": hash("abc"),
        "warning_filters": list(warnings.filters),
        "ignored_warning_shown": len(caught),
        "logger": (logger.level, logger.propagate, logger.disabled),
        "handlers": [handler_summary(h) for h in logger.handlers if type(h).__module__ == "logging"],
        "matmul": torch.get_float32_matmul_precision(),
        "draws": (random.random(), torch.rand(2).tolist()),
        "umask": umask,
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE),
    }


def handler_summary(handler: logging.Handler) -> tuple[Any, ...]:
    """A handler's class, level, target and formatter (format, date format, style)."""
    formatter = handler.formatter
    fmt = None if formatter is None else (formatter._fmt, formatter.datefmt, type(formatter._style).__name__)
    stream = getattr(handler, "stream", None)
    target = getattr(handler, "baseFilename", None) or ("stderr" if stream is sys.stderr else repr(stream))
    return type(handler).__name__, handler.level, target, fmt


def hash_and_log(name: str) -> int:
    """The issue's examples: log at INFO through a module logger, and return ``hash("abc")``."""
    logging.getLogger(name).info("info from rank %d", worker_info().rank)
    return hash("abc")
