"""RankStream, in one process."""

from __future__ import annotations

import io
import sys

import pytest

from mplaunch._output import RankStream


def test_lines_are_prefixed_whole_and_the_rest_flushed_on_close() -> None:
    console, log = io.StringIO(), io.StringIO()
    stream = RankStream(console, log, "[rank 1] ")
    stream.write("a")
    assert console.getvalue() == ""
    stream.write("b\nc\nd")
    stream.close()
    assert console.getvalue() == log.getvalue() == "[rank 1] ab\n[rank 1] c\n[rank 1] d\n"


def test_behaves_like_a_console_stream() -> None:
    stream = RankStream(sys.__stdout__, None, "")
    assert stream.fileno() == sys.__stdout__.fileno() and stream.encoding and not stream.isatty()
    with pytest.raises(io.UnsupportedOperation):
        RankStream(None, io.StringIO(), "").fileno()
