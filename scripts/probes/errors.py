"""The errors a stage reports as one clear message and exit code 1 (no traceback).

Every module's own error class (DataError, LengthsError, GateError, ...) derives from ProbeError,
so the one entry point in probes.stage handles them all the same way.
"""


class ProbeError(Exception):
    """An input the stage cannot use: the message names the file, row or key and what to do."""


class ControlFailedError(ProbeError):
    """A positive control did not recover its known answer: the instrument is not trusted."""
