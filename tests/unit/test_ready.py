"""Waiting for descriptors (:mod:`mplaunch._platform.ready`)."""

from __future__ import annotations

import os
import time

from mplaunch._platform.ready import readable


def test_a_wait_longer_than_poll_can_take_is_cut_to_polls_longest() -> None:
    """A launch with ``timeout=30 * 86400`` failed with ``OverflowError: timeout is too large``: poll takes at
    most 2**31 - 1 milliseconds (24.8 days)."""
    read, write = os.pipe()
    try:
        os.write(write, b"x")
        assert readable([read], 30 * 86400.0) == [read]
    finally:
        os.close(read)
        os.close(write)


def test_readable_answers_as_the_descriptors_are() -> None:
    """A pipe with data is readable at once; one without, not within the timeout; a closed writer reads as
    an end (hang-up)."""
    read, write = os.pipe()
    try:
        started = time.monotonic()
        assert readable([read], 0.05) == []
        assert time.monotonic() - started >= 0.04
        os.close(write)
        write = -1
        assert readable([read], None) == [read]
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
