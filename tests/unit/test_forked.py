"""probes.forked: a function run in a forked child; its result back, its failure one named error."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from probes.errors import ProbeError
from probes.forked import ForkedError, forked


class OwnError(ProbeError):
    pass


def test_the_childs_result_comes_back_from_another_process():
    with forked(
        lambda a, b: {"sum": a + b, "pid": os.getpid()}, (2, 3), what="x", timeout=60
    ) as done:
        mine = os.getpid()
        result = done()
    assert result["sum"] == 5 and result["pid"] != mine
    assert multiprocessing.active_children() == []


def test_a_child_that_raises_is_one_named_error_of_the_callers_class():
    def fail():
        raise ValueError("bad input")

    with (
        pytest.raises(
            OwnError, match=r"^the work \(child process \d+\) failed: ValueError: bad input$"
        ),
        forked(fail, (), what="the work", timeout=60, error=OwnError) as done,
    ):
        done()
    # a result that cannot be pickled back is the child's failure too, named
    with (
        pytest.raises(ForkedError, match=r"failed: .*pickle"),
        forked(lambda: lambda: 1, (), what="the work", timeout=60) as done,
    ):
        done()


def test_a_child_that_dies_or_hangs_is_named_with_how():
    with (
        pytest.raises(ForkedError, match=r"exit code 3 before reporting a result"),
        forked(lambda: os._exit(3), (), what="the work", timeout=60) as done,
    ):
        done()
    with (
        pytest.raises(
            ForkedError, match=r"^the work \(child process \d+\) reported nothing in 0 s"
        ),
        forked(time.sleep, (120,), what="the work", timeout=0.2) as done,
    ):
        done()
    assert multiprocessing.active_children() == []  # the sleeping child was terminated


def test_a_parent_that_fails_inside_the_block_terminates_the_child():
    with (
        pytest.raises(RuntimeError, match="parent failed"),
        forked(time.sleep, (120,), what="x", timeout=60),
    ):
        raise RuntimeError("parent failed")
    assert multiprocessing.active_children() == []
