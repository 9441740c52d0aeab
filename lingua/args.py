"""Configs: nested dataclasses filled from a YAML file (`config=PATH`) and dotted `key=value` overrides.

Every component owns a dataclass next to its code; an app's top-level config nests them. Values are converted to
the annotated type of their field, so `model.dim=64` gives an int and `optim.lr=1e-3` a float. A mistake (unknown
key, wrong type, missing value, a value out of range) raises `UserError` with one line naming the key.

Each dataclass checks its own values in `__post_init__` with `require` / `at_least`, naming the field; `from_dict`
adds the path of the enclosing config, so the message names the full key (`model.encoder.n_layers`).
"""

import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import math
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from lingua.errors import ConfigError, UserError
from lingua.files import untrusted
from lingua.files.safe import atomic_write

T = TypeVar("T")


class HelpRequested(Exception):
    """`--help` (or `-h`) was given: `text` lists the keys; entry points print it and exit 0."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


OLDEST_TORCH = (2, 11)  # the oldest torch the library runs on (the tests run on it and on the pinned 2.13)


def require_supported_torch() -> None:
    import torch

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if release < OLDEST_TORCH:
        raise UserError(f"torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_TORCH))}, the oldest "
                        "this library runs on: install torch 2.11 or newer (requirements.txt pins 2.13.0)")


@contextlib.contextmanager
def command_line(usage: str):
    """The body of a command's main: the installed torch is checked, `--help` prints `usage` and the keys (exit 0);
    a UserError prints one line (exit 2)."""
    try:
        require_supported_torch()
        yield
    except HelpRequested as e:
        print(f"{(usage or '').strip()}\n\n{e.text}")
        sys.exit(0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def load_config(cls: type[T], argv: list[str], base: dict[str, Any] | None = None) -> T:
    """Build `cls` from `base` (a nested dict), then `config=PATH` (optional) and dotted `key=value` overrides, in
    order. A class with a field of its own named `config` (stool's: the run's base config) takes it as a value."""
    if "--help" in argv or "-h" in argv:
        raise HelpRequested(config_help(cls, base))
    tree: dict[str, Any] = copy.deepcopy(base or {})  # overrides write into nested sections: never into the caller's
    config_is_a_file = "config" not in {f.name for f in dataclasses.fields(cls)}
    for arg in argv:
        key, value = parse_assignment(arg)
        if key == "config" and config_is_a_file:
            tree = _merge(tree, read_yaml(value))
        else:
            set_dotted(tree, key, value)
    return from_dict(cls, tree)


def parse_assignment(arg: str) -> tuple[str, Any]:
    """`key=value` -> (key, the value read as YAML; an empty value is the empty string)."""
    key, sep, value = arg.partition("=")
    if not sep or not key:
        raise UserError(f"expected key=value, got '{arg}'")
    return key, untrusted.parse_value(value, f"the value of config key '{key}'") if value else ""


def from_dict(cls: type[T], tree: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict, converting and checking every value."""
    if not isinstance(tree, dict):
        raise UserError(f"config key '{prefix.rstrip('.') or '<root>'}' expects a mapping, got {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(tree) - set(fields))
    if unknown:
        raise UserError(f"unknown config key '{prefix}{unknown[0]}' (valid keys: {', '.join(sorted(fields))})")
    values = {}
    for name, field in fields.items():
        key = prefix + name
        if dataclasses.is_dataclass(hints[name]) and isinstance(tree.get(name, {}), dict):
            # a nested config starts from its field's default (which may differ from its class's defaults)
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
            base = to_dict(default) if dataclasses.is_dataclass(default) else {}
            values[name] = from_dict(hints[name], _merge(base, tree.get(name, {})), key + ".")
        elif name in tree:
            values[name] = _convert(hints[name], tree[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise UserError(f"missing required config value '{key}'")
    try:
        return cls(**values)
    except ConfigError as e:  # raised by cls.__post_init__ with the field's own name
        raise ConfigError(prefix + e.key, e.problem) from None


def config_help(cls: type, base: dict[str, Any] | None = None) -> str:
    """One line per key of `cls`, dotted: its type, its default (after `base`) and the comment beside its field."""
    lines = ["keys (key=value; config=PATH reads a YAML file of them first):"]
    for key, tp, default, comment in _help_rows(cls, base or {}, ""):
        lines.append(f"  {key}: {tp} = {default}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines)


def _help_rows(cls: type, base: dict[str, Any], prefix: str):
    hints, comments = typing.get_type_hints(cls), _field_comments(cls)
    for field in dataclasses.fields(cls):
        tp, key = hints[field.name], prefix + field.name
        if dataclasses.is_dataclass(tp):
            nested = base.get(field.name, {}) if isinstance(base.get(field.name), dict) else {}
            yield from _help_rows(tp, nested, key + ".")
            continue
        if field.name in base:
            default = base[field.name]
        elif field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = "(required)"
        yield key, _type_name(tp), default if default == "(required)" else repr(default), comments.get(field.name, "")


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the source of cls and its dataclass bases."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        comments |= _comments_by_field(source)
    return comments


def _comments_by_field(class_source: str) -> dict[str, str]:
    """{field: its whole comment} from a class's source: the comment on the field's line and the comment lines right
    below it, which continue it. Read with tokenize, so that a `#` inside a string is no comment."""
    comments: dict[str, list[str]] = {}
    depth, code, line_comments, continued = 0, [], [], None  # continued: the field whose comment goes on below
    for token in tokenize.generate_tokens(io.StringIO(class_source).readline):
        kind, text = token.type, token.string
        if kind == tokenize.INDENT:
            depth += 1
        elif kind == tokenize.DEDENT:
            depth -= 1
        elif kind == tokenize.COMMENT:
            part = text.lstrip("#").strip()
            if code:
                line_comments.append(part)
            elif continued is not None:
                comments[continued].append(part)
        elif kind == tokenize.NEWLINE:  # the end of a statement, perhaps over several lines
            is_field = depth == 1 and len(code) > 1 and code[0].type == tokenize.NAME and code[1].string == ":"
            continued = code[0].string if is_field and line_comments else None
            if continued is not None:
                comments[continued] = line_comments
            code, line_comments = [], []
        elif kind == tokenize.NL:
            if not code and token.line.strip() == "":
                continued = None  # a blank line ends a comment
        elif kind != tokenize.ENDMARKER:
            code.append(token)
    return {name: " ".join(parts) for name, parts in comments.items()}


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every leaf that differs between two config dicts."""
    changes = {}
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and a and b:
            changes |= config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes[prefix + key] = (a, b)
    return changes


def dump_config(cfg: Any, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping ({} when empty); what cannot be read is a one-line UserError."""
    return untrusted.read_yaml(path, "config file")


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree[a][b][c] = value for key `a.b.c`, making (or replacing with) a dict at each level on the way."""
    *parents, leaf = key.split(".")
    for part in parents:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[leaf] = value


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin, params = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in params:
            return None
        errors = []
        for option in (p for p in params if p is not type(None)):
            try:
                return _convert(option, value, key)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin is list:
        if isinstance(value, str):
            items = value.split(",")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            items = [value]  # `knn_k=5` on the command line is a one-element list
        else:
            items = value
        if not isinstance(items, list):
            raise _type_error(key, "a list", value)
        return [_convert(params[0], item, f"{key}[{i}]") for i, item in enumerate(items)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, "a mapping", value)
        return {str(k): _convert(params[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    return _convert_scalar(tp, value, key)


def _convert_scalar(tp: type, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, "true or false", value)
    if tp is int:
        number = _as_number(value)
        if number is not None and math.isfinite(number) and float(number).is_integer() and abs(number) < 2**63:
            return int(number)  # allows 1e6
        raise _type_error(key, "an integer (below 2^63 in size)", value)
    if tp is float:
        number = _as_number(value)
        if number is not None and math.isfinite(number):
            return float(number)
        raise _type_error(key, "a finite number", value)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, "a string", value)
    raise TypeError(f"config field '{key}' has unsupported type {tp}")


def _as_number(value: Any) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:  # YAML 1.1 reads "1e-3" and "1e6" (no dot) as strings
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _type_error(key: str, expected: str, value: Any) -> UserError:
    return UserError(f"config key '{key}' expects {expected}, got {value!r}")
