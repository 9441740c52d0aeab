"""The one error a user can fix, raised by every layer (the readers of files included) in one line."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file); entry points print it on one line and exit 2."""
