"""The one error a user can fix. Its own module so that every layer, the readers of files included, can raise it."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file); entry points print it on one line and exit 2."""
