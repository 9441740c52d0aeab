"""The one reader of JSON and YAML from disk: files anyone may have written (a run folder someone sent, a downloaded
corpus, a hand-edited config) are read as plain data, within limits, and every way one can be wrong is a one-line
UserError naming the file (and line):

- only a regular file is opened (a FIFO would block the reader forever), of at most MAX_BYTES;
- strict UTF-8 (a byte-order mark is dropped);
- at most MAX_DEPTH levels of nesting, checked before parsing: a deeper file exhausts the recursion of the parser,
  or of whoever walks what it returns;
- numbers within Python's limit on the digits of an integer;
- YAML: aliases are allowed (configs share values with anchors and merge keys), but the document they expand to
  is bounded, MAX_NODES values at most and MAX_DEPTH levels: a few hundred bytes of nested aliases expand to 10^9
  values in whoever walks what it returns; an alias inside the node it names (a cycle) is refused;
- YAML: a key written twice in one mapping is refused (PyYAML would keep the last one silently); only safe_load's
  plain types are built;
- `expect`: the type the top level must have (a mapping, say), else refused.

Callers that tolerate a bad file (a status table) catch the UserError; one that skips bad lines of a corpus parses
each with `parse_json(line, dict)` and catches Malformed.
"""

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from lingua.errors import UserError

MAX_DEPTH = 100
MAX_NODES = 10**6  # the values of a YAML document with its aliases expanded
MAX_BYTES = 64 * 2**20  # of a JSON or YAML file read whole (a corpus is parsed a line at a time: not bounded here)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class Malformed(ValueError):
    """What is wrong with a text (a phrase); the readers of files add which file, or which line, it is."""


# ------------------------------------------------------------------------------------------------------ files


def read_bytes(path: str | Path, what: str = "file") -> bytes:
    """The bytes of a regular file; `what` names it in errors ("config file", "stage record")."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once and is refused below
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise UserError(f"{what} {path} is " + ("a folder, not a file" if stat.S_ISDIR(mode) else "not a regular file"))
    with os.fdopen(descriptor, "rb") as f:
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{what} {path} is larger than {MAX_BYTES // 2**20} MiB, more than any record or config")
    return data


def read_json(path: str | Path, what: str = "file", expect: type | None = dict) -> Any:
    """A JSON file's value, of type `expect` (None: any)."""
    try:
        return parse_json(read_bytes(path, what), expect)
    except Malformed as e:
        raise UserError(f"{what} {path}: {e}") from None


def read_yaml(path: str | Path, what: str = "file", expect: type | None = dict) -> Any:
    """A YAML file's value, of type `expect` (None: any); an empty file is {} where a mapping is due."""
    try:
        value = parse_yaml(read_bytes(path, what))
        return {} if value is None and expect is dict else _expect(value, expect, "YAML")
    except Malformed as e:
        raise UserError(f"{what} {path}: {e}") from None


def parse_json_line(path: str | Path, line_no: int, line: str | bytes) -> dict:
    """One JSONL line that must be a JSON object, else a UserError naming path:line."""
    try:
        return parse_json(line, dict)
    except Malformed as e:
        raise UserError(f"{path}:{line_no}: {e}") from None


def parse_value(text: str, where: str) -> Any:
    """A YAML value given on the command line (`where` names it: "the value of key 'eval.tasks'")."""
    try:
        return parse_yaml(text)
    except Malformed as e:
        raise UserError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------------------------------ parsing


def parse_json(data: str | bytes, expect: type | None = None) -> Any:
    """The value of a JSON text (bytes: strict UTF-8), of type `expect` (None: any), else Malformed."""
    text = _decode(data) if isinstance(data, bytes) else data
    if text.count("[") + text.count("{") > MAX_DEPTH:  # only then can it be too deep: scan the brackets
        depth = deepest = 0
        for bracket in _BRACKET.findall(_JSON_STRING.sub("", text)):
            depth += 1 if bracket in "[{" else -1
            deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # Python's limit on the digits of an integer
        raise Malformed(_invalid("JSON", e)) from None
    return _expect(value, expect, "JSON")


def parse_yaml(data: str | bytes) -> Any:
    text = _decode(data) if isinstance(data, bytes) else data
    try:
        return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 (a SafeLoader: plain types only)
    except yaml.YAMLError as e:
        raise Malformed(f"not valid YAML: {_yaml_problem(e)}") from None
    except ValueError as e:  # the digit limit, or a value its type refuses (a date 2024-13-45)
        raise Malformed(_invalid("YAML", e)) from None


class _PlainLoader(yaml.SafeLoader):
    """safe_load's plain types, with the nesting depth and the expanded size bounded and a key written twice in one
    mapping refused."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels (line {line})")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node):
        values, depth = _expanded(node)
        if values > MAX_NODES:
            raise yaml.YAMLError(f"its aliases expand it to more than {MAX_NODES:,} values")
        if depth > MAX_DEPTH:
            raise yaml.YAMLError(f"its aliases nest it deeper than {MAX_DEPTH} levels")
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise yaml.YAMLError(f"key {key!r} is written twice (lines {first_line[key]} and {line})")
                first_line[key] = line
        return super().construct_mapping(node, deep)


def _expanded(root: yaml.Node) -> tuple[int, int]:
    """(values, depth) of a composed YAML document with its aliases expanded: each node is counted once and its
    count reused wherever an alias names it, so the walk is linear in the document, not in its expansion. Iterative:
    aliases can chain nodes deeper than Python's recursion."""
    counted: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()  # on the path from the root to the node being walked
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_counted = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else [part for pair in node.value for part in pair]
        if children_counted:
            open_nodes.discard(id(node))
            values, depths = zip(*(counted[id(child)] for child in children)) if children else ((), ())
            counted[id(node)] = (1 + sum(values), 1 + max(depths, default=0))
        elif id(node) in open_nodes:
            raise yaml.YAMLError(f"the node at line {node.start_mark.line + 1} holds an alias of itself")
        elif id(node) not in counted:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in counted)
    return counted[id(root)]


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise Malformed(f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def _invalid(language: str, error: ValueError) -> str:
    if "digits" in str(error):
        return f"holds a number of more than {sys.get_int_max_str_digits()} digits"
    return f"not valid {language}: {error}"


_TYPE_NAMES = {dict: "a mapping", list: "a list", str: "a string"}


def _expect(value: Any, expect: type | None, language: str) -> Any:
    if expect is not None and not isinstance(value, expect):
        wanted = "a JSON object" if expect is dict and language == "JSON" else _TYPE_NAMES.get(expect, expect.__name__)
        raise Malformed(f"expected {wanted}, got {type(value).__name__}")
    return value
