"""Errors the command line reports as one line: bad input (exit code 2), a full state disk."""

import errno


class UserError(Exception):
    """Bad input from the user: reported as one line on stderr, nothing written."""


class StateStorageFull(OSError):
    """The state folder's disk (or quota) is full: no trial's fault, so no trial fails for it; the
    run stops with one line and resumes from its record once there is space again."""

    @classmethod
    def check(cls, error: OSError, doing: str) -> OSError:
        """`error` as a StateStorageFull when it says the disk is full (to raise instead), else itself."""
        if isinstance(error, cls) or error.errno not in (errno.ENOSPC, errno.EDQUOT):
            return error
        return cls(error.errno, f"No space left on device: the state folder's disk is full ({doing})")
