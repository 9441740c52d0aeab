"""The errors a user can fix, raised by every layer (the readers of files included) in one line, and the checks of
a config value that raise them."""

from typing import Any


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file); entry points print it on one line and exit 2."""


class ConfigError(UserError):
    """An invalid value of config field `key` (relative to the dataclass that raised it)."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"config key '{key}' {problem}")


def require(condition: bool, key: str, problem: str) -> None:
    if not condition:
        raise ConfigError(key, problem)


def at_least(cfg: Any, minimum: float, *names: str) -> None:
    """Each named field of `cfg` (None allowed: an optional, unset value) is >= minimum."""
    for name in names:
        value = getattr(cfg, name)
        require(value is None or value >= minimum, name, f"must be >= {minimum}, got {value}")
