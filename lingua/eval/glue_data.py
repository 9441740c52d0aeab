"""The GLUE tasks and their splits: each task's definition (files, columns, labels, metrics) and the reading of its
train and dev splits from the original TSV files or the HF hub, malformed lines skipped, counted and reported once.
Fine-tuning (apps/finetune), the offline MTEB stand-ins and the tables read them too; the probes are
lingua/eval/glue.py.
"""

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lingua.data.documents import SkippedRows
from lingua.errors import UserError

logger = logging.getLogger(__name__)

HF_GLUE = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    name: str  # config and results key, and the HF hub's configuration name
    title: str  # column name in the paper's tables
    folder: str  # folder in the original GLUE layout
    text_columns: tuple[str, ...]  # one sentence, or a pair
    label_column: str
    labels: tuple[str, ...]  # label strings in the HF hub's label order; empty for regression (STS-B)
    metrics: tuple[str, ...]
    headline: str  # the table's single number for this task
    hf_text_columns: tuple[str, ...]
    dev_file: str = "dev"  # validation split's file name, without .tsv
    columns: tuple[str, ...] = ()  # column names of a file without a header line (CoLA)

    @property
    def regression(self) -> bool:
        return not self.labels


ENTAILMENT = ("entailment", "not_entailment")
PAIR = ("sentence1", "sentence2")
TASKS = {task.name: task for task in [  # in the paper's column order
    GlueTask(name="mnli", title="MNLI", folder="MNLI", dev_file="dev_matched", text_columns=PAIR,
             label_column="gold_label", labels=("entailment", "neutral", "contradiction"), metrics=("acc",),
             headline="acc", hf_text_columns=("premise", "hypothesis")),
    GlueTask(name="qnli", title="QNLI", folder="QNLI", text_columns=("question", "sentence"), label_column="label",
             labels=ENTAILMENT, metrics=("acc",), headline="acc", hf_text_columns=("question", "sentence")),
    GlueTask(name="qqp", title="QQP", folder="QQP", text_columns=("question1", "question2"),
             label_column="is_duplicate", labels=("0", "1"), metrics=("acc", "f1"), headline="acc",
             hf_text_columns=("question1", "question2")),
    GlueTask(name="rte", title="RTE", folder="RTE", text_columns=PAIR, label_column="label", labels=ENTAILMENT,
             metrics=("acc",), headline="acc", hf_text_columns=PAIR),
    GlueTask(name="sst2", title="SST2", folder="SST-2", text_columns=("sentence",), label_column="label",
             labels=("0", "1"), metrics=("acc",), headline="acc", hf_text_columns=("sentence",)),
    GlueTask(name="mrpc", title="MRPC", folder="MRPC", text_columns=("#1 String", "#2 String"),
             label_column="Quality", labels=("0", "1"), metrics=("acc", "f1"), headline="acc", hf_text_columns=PAIR),
    GlueTask(name="cola", title="CoLA", folder="CoLA", text_columns=("sentence",), label_column="label",
             labels=("0", "1"), metrics=("mcc",), headline="mcc", hf_text_columns=("sentence",),
             columns=("source", "label", "original_mark", "sentence")),
    GlueTask(name="stsb", title="STSB", folder="STS-B", text_columns=PAIR, label_column="score", labels=(),
             metrics=("pearson", "spearman"), headline="spearman", hf_text_columns=PAIR),
]}

class MissingSplit(Exception):
    """A split that is not available; the task is skipped with this message."""


@dataclass
class GlueSplit:
    texts: list[tuple[str, ...]]  # one tuple per example: (sentence,) or (sentence_a, sentence_b)
    labels: Tensor  # class indices (long) or scores (float)
    skipped: int = 0  # malformed lines left out
    unknown_label: str | None = None  # the first label outside the task's set (its line is among the skipped)
    first_skipped: str = ""  # where the first malformed line is ("line 7", "row 7")

    def subset(self, index: Tensor) -> "GlueSplit":
        return GlueSplit([self.texts[i] for i in index.tolist()], self.labels[index], self.skipped,
                         self.unknown_label, self.first_skipped)


def read_glue_tsv(path: str | Path, task: GlueTask) -> GlueSplit:
    """One split in the original GLUE TSV format.

    Lines end at a line feed alone (a lone carriage return is part of its sentence; a CRLF ending is removed) and
    their fields are split at tabs, with no quote handling (some sentences start with a lone `"`) and no size limit.
    MRPC's header starts with a byte-order mark; CoLA has no header; MNLI has extra columns (parses, several annotator
    labels). Lines that are not UTF-8, whose field count differs from the header's (QQP has some) or whose label is
    not a known one are skipped and counted.
    """
    with open(path, "rb") as f:
        return _read_rows(((number, _fields(line)) for number, line in enumerate(f, 1)), task, path)


def _fields(line: bytes) -> list[str] | None:
    """The tab-separated fields of one line, or None when it is not UTF-8."""
    try:
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    return text.removesuffix("\n").removesuffix("\r").split("\t")


def _read_rows(rows, task: GlueTask, path: str | Path) -> GlueSplit:
    header = list(task.columns) or next(rows, (1, []))[1]
    if header is None:
        raise UserError(f"{path} is not a GLUE TSV file (its header line is not UTF-8)")
    missing = [c for c in (*task.text_columns, task.label_column) if c not in header]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} in header {header} (is this {task.title}?)")
    text_idx = [header.index(c) for c in task.text_columns]
    label_idx = header.index(task.label_column)
    texts, labels, skipped, unknown = [], [], SkippedRows(), None
    for number, row in rows:
        fits = row is not None and len(row) == len(header)
        label = _parse_label(task, row[label_idx]) if fits else None
        if label is None:
            skipped.add(f"line {number}")
            unknown = unknown or (row[label_idx] if fits else None)
            continue
        texts.append(tuple(row[i] for i in text_idx))
        labels.append(label)
    return GlueSplit(texts, _label_tensor(task, labels), skipped.count, unknown, skipped.first)


def _parse_label(task: GlueTask, value: str) -> float | int | None:
    if task.regression:
        try:
            score = float(value)
        except ValueError:
            return None
        return score if math.isfinite(score) else None  # "nan" and "inf" parse, but are no score
    return task.labels.index(value) if value in task.labels else None


def _label_tensor(task: GlueTask, labels: list) -> Tensor:
    return torch.tensor(labels, dtype=torch.float32 if task.regression else torch.long)


def split_from_hf_rows(task: GlueTask, rows) -> GlueSplit:
    """A split from HF `nyu-mll/glue` rows (dicts); their integer labels already follow `task.labels`' order."""
    texts, labels, skipped = [], [], SkippedRows()
    for number, row in enumerate(rows, 1):
        label = row["label"]
        valid = math.isfinite(label) if task.regression else 0 <= label < len(task.labels)  # -1: unlabelled
        if not valid:
            skipped.add(f"row {number}")
            continue
        texts.append(tuple(row[c] for c in task.hf_text_columns))
        labels.append(label)
    return GlueSplit(texts, _label_tensor(task, labels), skipped.count, first_skipped=skipped.first)


def load_hf_split(task: GlueTask, split: str) -> GlueSplit:
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the HuggingFace `datasets` package (pip install datasets); "
                        "or pass data=GLUE_DIR, a folder in the original GLUE TSV layout") from None
    hf_split = "train" if split == "train" else ("validation_matched" if task.name == "mnli" else "validation")
    try:
        rows = datasets.load_dataset(HF_GLUE, task.name, split=hf_split)
    except Exception as e:  # network, hub or cache errors of any kind: the task cannot be loaded
        raise MissingSplit(f"{HF_GLUE}/{task.name} {hf_split}: {str(e).splitlines()[0] if str(e) else e!r}")
    return split_from_hf_rows(task, rows)


class SkippedLinesReport:
    """Reports each split's malformed lines once per file (and version of it): the reader of a run that reads the
    same files again (the probes during training, at every evaluation) keeps one. A quiet one reports nothing: a
    check whose reads the run repeats, and reports, later."""

    def __init__(self, quiet: bool = False):
        self.reported: set[tuple] = set()
        self.quiet = quiet

    def report(self, task: GlueTask, split: str, source: str, version: tuple | None, data: GlueSplit) -> None:
        if data.skipped and not self.quiet and (source, version) not in self.reported:
            self.reported.add((source, version))
            logger.warning(f"{task.title} {split}: {source}: skipped {data.skipped} malformed lines (the first at "
                           f"{data.first_skipped})")


def load_split(task: GlueTask, split: str, data: str, strict: bool = False,
               report: SkippedLinesReport | None = None) -> GlueSplit:
    """The "train" or "dev" split of `task` from a GLUE folder or, with data="hf", from the HF hub. A line whose
    label is outside the task's set is skipped and counted, or with `strict` a UserError. Malformed lines are
    reported through `report` (once per file), else at every call; a file with no usable line is a UserError."""
    if data == "hf":
        result, source, version = load_hf_split(task, split), f"{HF_GLUE}/{task.name} {split}", None
    else:
        path = Path(data) / task.folder / f"{'train' if split == 'train' else task.dev_file}.tsv"
        if not path.is_file():
            raise MissingSplit(f"no {split} split, {path} not found")
        stat = os.stat(path)
        result, source, version = read_glue_tsv(path, task), str(path), (stat.st_size, stat.st_mtime_ns)
    if strict and result.unknown_label is not None:
        raise UserError(f"{task.title} {split}: label {result.unknown_label!r} is not one of the task's "
                        f"({', '.join(task.labels) or 'a finite score'})")
    if not result.texts:
        if data == "hf":
            raise MissingSplit(f"the {split} split has no usable example")
        why = f"{result.skipped} malformed lines, the first at {result.first_skipped}" if result.skipped else "no line"
        raise UserError(f"{source} has no usable {task.title} example ({why})")
    (report or SkippedLinesReport()).report(task, split, source, version, result)
    return result
