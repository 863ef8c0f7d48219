"""Errors the command line reports as one line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: reported as one line on stderr, nothing written."""
