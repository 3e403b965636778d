"""The one exception type users see: its message names the bad input and what to do about it."""


class MedusaError(Exception):
    """A user-facing error (bad flag, config key, path or request field). Never a bug."""
