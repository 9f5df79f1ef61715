"""One function run in a forked child process while the parent does its own work.

`with forked(function, args, what=..., timeout=...) as done:` starts the child; `done()` waits for
its picklable result. A child that raises, dies before reporting or reports nothing within
`timeout` becomes one error naming `what` (its traceback, where it raised, logged by the parent),
never a bare traceback. A child still running when the block ends (the parent's own work failed)
is terminated.

fork, not spawn or forkserver: the child inherits what the parent has built (a parsed file, a fake
model) instead of building it again, and the entry script is not re-run (under Snakemake's
script:, that would run the rule again). Whether fork is safe depends on what the parent has run
before it: each caller says why it is, beside its call.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import sys
from collections.abc import Callable, Iterator, Sequence
from traceback import format_exc
from typing import Any

from probes.errors import ProbeError

log = logging.getLogger(__name__)


class ForkedError(ProbeError):
    """A forked child raised, died or hung: the message names its work and how it ended."""


def run_and_report(report: Any, function: Callable[..., Any], args: Sequence[Any]) -> None:
    """The child's side: `function(*args)`'s result, or its error named, sent through report;
    a child that raised exits 1."""
    try:
        report.send({"result": function(*args)})
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then exit 1
        report.send({"error": f"{type(error).__name__}: {error}", "trace": format_exc()})
        report.close()
        sys.exit(1)
    report.close()


def child_result(child: Any, report: Any, what: str, timeout: float, error: type[Exception]) -> Any:
    """Wait for the child's report; its failure, crash or hang as `error`."""
    what = f"{what} (child process {child.pid})"
    if not report.poll(timeout):
        raise error(f"{what} reported nothing in {timeout:.0f} s")
    try:
        outcome = report.recv()
    except EOFError:
        child.join()
        raise error(
            f"{what} ended with exit code {child.exitcode} before reporting a result"
        ) from None
    child.join()
    if "error" in outcome:
        log.error("%s failed; its traceback:\n%s", what, outcome["trace"])
        raise error(f"{what} failed: {outcome['error']}")
    return outcome["result"]


@contextlib.contextmanager
def forked(
    function: Callable[..., Any],
    args: Sequence[Any],
    *,
    what: str,
    timeout: float,
    error: type[Exception] = ForkedError,
    name: str | None = None,
) -> Iterator[Callable[[], Any]]:
    """Within this block `function(*args)` runs in a forked child (args inherited, not pickled);
    yields a function that waits for its result (pickled back). `what` names the work in the
    errors ("the tokenizer build"); `timeout` is counted from that wait."""
    context = multiprocessing.get_context("fork")
    report, child_end = context.Pipe(duplex=False)
    child = context.Process(
        target=run_and_report, args=(child_end, function, args), name=name, daemon=True
    )
    child.start()
    child_end.close()
    try:
        yield lambda: child_result(child, report, what, timeout, error)
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        report.close()
