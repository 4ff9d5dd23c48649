"""Exception types.

`MsprobeError` is a user or input problem (bad config value, malformed dump, missing file): its message is one
line naming the file or field and what was expected. `MsprobeInternalError` is a broken invariant inside
msprobe-ci; it is deliberately *not* a subclass of `MsprobeError`, so ``except MsprobeError`` never hides a bug.
"""


class MsprobeError(Exception):
    """A user-facing error: bad configuration, bad input file, or an impossible request."""


class MsprobeInternalError(RuntimeError):
    """A broken invariant inside msprobe-ci. Please file a bug with the message."""

    def __init__(self, message: str):
        super().__init__(f"{message} (internal error in msprobe-ci; please report it)")
