"""One JSONL line's document as tokens (`<s> text </s>`), and the count of the malformed rows a reader skips.

Its own file because every reader of rows shares it: the training stream (lingua/source_stream.py), the validation
rows (lingua/validation_rows.py), the GLUE TSV files (lingua/eval/glue_data.py) and the contrastive pairs.
"""

from lingua.untrusted import parse_json


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


def document(tokenizer, line: bytes) -> list[int] | None:
    """The tokens of one JSONL line's document (<s> text </s>), or None when the line is malformed."""
    try:
        doc = parse_json(line, dict) if line.strip() else {}
        text = doc.get("text")
        return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id] if isinstance(text, str) else None
    except ValueError:  # Malformed (bad UTF-8 or JSON, a number past the digit limit, nesting) or lone surrogates
        return None
