"""One JSONL line's document as tokens (`<s> text </s>`), and the count of the malformed rows a reader skips. Every
reader of rows shares it: the training stream (lingua/data/source_stream.py), the validation rows
(lingua/data/loader.py), the GLUE TSV files (lingua/eval/glue_data.py) and the contrastive pairs.
"""

from lingua.files.untrusted import Malformed, parse_json


class SkippedRows:
    """The bad rows of one file (or of one rank's share of it), skipped and counted: the file gets one warning, with
    the count and where the first one is."""

    def __init__(self):
        self.count, self.first = 0, ""

    def add(self, where: str) -> None:
        self.count += 1
        self.first = self.first or where

    def warning(self, path, rows: str) -> str:
        return f"{path}: skipped {self.count} {rows} (the first at {self.first})"


class MalformedLine(ValueError):
    """A line that holds no document; its text says why."""


def text_of_json(line: bytes, text_field: str = "text") -> str:
    """The text of one JSON line's document; raises MalformedLine saying why there is none."""
    if not line.strip():
        raise MalformedLine("an empty line")
    try:
        doc = parse_json(line)
    except Malformed as e:  # bad UTF-8 or JSON, a number past the digit limit, nesting
        raise MalformedLine(str(e)) from None
    text = doc.get(text_field) if isinstance(doc, dict) else None
    if not isinstance(text, str):
        raise MalformedLine(f'no "{text_field}" string in it')
    return text


def tokens_of(tokenizer, text: str) -> list[int]:
    """A document's tokens, <s> text </s>; raises MalformedLine when the text is not valid Unicode."""
    try:
        return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    except ValueError:  # lone surrogates
        raise MalformedLine("its text is not valid Unicode") from None


def read_document(tokenizer, line: bytes) -> list[int]:
    """The tokens of one JSONL line's document (<s> text </s>); raises MalformedLine saying why there is none."""
    return tokens_of(tokenizer, text_of_json(line))


def document(tokenizer, line: bytes) -> list[int] | None:
    """The tokens of one JSONL line's document (<s> text </s>), or None when the line is malformed."""
    try:
        return read_document(tokenizer, line)
    except MalformedLine:
        return None
