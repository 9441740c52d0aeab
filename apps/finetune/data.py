"""GLUE fine-tuning data: one task's train split in shuffled batches padded to their longest example, and its dev
split for the evaluation after each epoch.

Examples are encoded as the frozen probes encode them (lingua/eval/features.py: `<s> a </s></s> b </s>`, at most
`seq_len` tokens). Each row of a batch is the label, then the tokens, padded with the pad id to the batch's longest
example rounded up to a multiple of 8 (so a compiled or GPU step sees few distinct shapes); a regression score
(STS-B) travels as the bits of its float32. Every epoch is a new seeded permutation of the train split, cut into
global batches of `batch_size` examples per process (the last, incomplete one is dropped); rank r takes the r-th
slice of each. The position (epoch, examples read) is the same on every rank, so a run resumes exactly (on as many
processes as it started on: apps/finetune/train.py refuses another number, whose epochs would differ).
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lingua.data.tokenizer import TokenizerArgs
from lingua.errors import UserError, at_least, require
from lingua.eval.features import encode_example
from lingua.eval.glue_data import TASKS, GlueTask, MissingSplit, SkippedLinesReport, load_split

logger = logging.getLogger(__name__)

PAD_MULTIPLE = 8


@dataclass
class GlueDataArgs:
    path: str = ""  # a folder in the original GLUE TSV layout (SST-2/train.tsv, ...), or "hf" for the HF hub
    task: str = "sst2"  # mnli, qnli, qqp, rte, sst2, mrpc, cola or stsb
    seq_len: int = 128  # the most tokens per example, <s> and </s> included (a pair's longer sentence is cut first)
    batch_size: int = 32  # examples per process and micro-batch: the protocol's batch is this x processes x grad_acc
    seed: int | None = None  # the order of the training examples (a new permutation each epoch); default: the run's
    max_train: int = 0  # train on at most this many examples, a fixed random subset (quick runs); 0: all
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)  # with init_from: the pre-trained run's

    def __post_init__(self):
        require(self.task in TASKS, "task", f"unknown GLUE task '{self.task}' (valid: {', '.join(TASKS)})")
        at_least(self, 6, "seq_len")  # a pair's four special tokens and a token of each sentence
        at_least(self, 1, "batch_size")
        at_least(self, 0, "max_train")
        require(self.seed is None or self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")

    @property
    def glue_task(self) -> GlueTask:
        return TASKS[self.task]


def read_split(args: GlueDataArgs, split: str, report: SkippedLinesReport | None = None):
    """The task's "train" (at most max_train examples) or "dev" split; one line for a missing split or a label
    outside the task's set; its malformed lines reported through `report` (default: a warning)."""
    task = args.glue_task
    if not args.path:
        raise UserError("data.path is required: a folder in the GLUE TSV layout (SST-2/train.tsv, ...), or hf")
    try:
        data = load_split(task, split, args.path, strict=True, report=report)
    except MissingSplit as e:
        raise UserError(f"{task.title}: {e}") from None
    if split == "train" and 0 < args.max_train < len(data.texts):
        keep = torch.randperm(len(data.texts), generator=torch.Generator().manual_seed(0))[:args.max_train]
        data = data.subset(keep.sort().values)
    return data


def label_codes(labels: torch.Tensor) -> torch.Tensor:
    """Class indices as they are; scores as the bits of their float32 (exact), so that a row stays one LongTensor."""
    return labels.view(torch.int32).long() if labels.is_floating_point() else labels


def decode_labels(codes: torch.Tensor, regression: bool) -> torch.Tensor:
    return codes.to(torch.int32).view(torch.float32) if regression else codes


def encode_split(args: GlueDataArgs, tokenizer, split: str) -> tuple[list[list[int]], torch.Tensor]:
    data = read_split(args, split)
    return [encode_example(tokenizer, texts, args.seq_len) for texts in data.texts], label_codes(data.labels)


def pad_rows(examples: list[list[int]], codes: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[label, tokens..., pad...] rows as long as the longest example, rounded up to a multiple of 8."""
    length = PAD_MULTIPLE * math.ceil(max(map(len, examples)) / PAD_MULTIPLE)
    rows = torch.full((len(examples), 1 + length), pad_id, dtype=torch.long)
    rows[:, 0] = codes
    for i, tokens in enumerate(examples):
        rows[i, 1:1 + len(tokens)] = torch.tensor(tokens)
    return rows


class GlueLoader:
    """Endless batches of this rank's slice of each global batch, epoch after epoch (the DataPipeline contract)."""

    def __init__(self, args: GlueDataArgs, tokenizer, rank: int, world_size: int, state: dict | None = None):
        self.args, self.rank, self.pad_id = args, rank, tokenizer.pad_id
        self.examples, self.codes = encode_split(args, tokenizer, "train")
        self.global_batch = args.batch_size * world_size  # steps_per_epoch checked that the split holds one
        self.malformed_lines = 0  # counted and logged when the split was read
        self.epoch, self.read = (state["epoch"], state["read"]) if state else (0, 0)
        self.order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.examples), generator=generator)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self.read + self.global_batch > len(self.examples):  # the epoch's last, incomplete batch is dropped
            self.epoch, self.read = self.epoch + 1, 0
            self.order = self._permutation()
        start = self.read + self.rank * self.args.batch_size
        index = self.order[start:start + self.args.batch_size].tolist()
        self.read += self.global_batch
        return pad_rows([self.examples[i] for i in index], self.codes[index], self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "read": self.read}

    def close(self) -> None:
        pass


def check_splits(args: GlueDataArgs) -> dict[str, int]:
    """Both splits read and checked at the start (the DataPipeline's `check`), so that bad data stops the run
    before anything is written; the facts the schedule follows from: {"train_rows": examples of the train split}.
    Their malformed lines are reported once, by the reads of the run itself."""
    quiet = SkippedLinesReport(quiet=True)
    read_split(args, "dev", quiet)
    return {"train_rows": len(read_split(args, "train", quiet).texts)}


def steps_per_epoch(examples: int, args: GlueDataArgs, world_size: int) -> int:
    """Optimizer steps in one pass over a train split of `examples` (its last, incomplete global batch dropped)."""
    batch = args.batch_size * world_size
    if examples < batch:
        raise UserError(f"{args.glue_task.title}: {examples} training examples, fewer than one step's batch of "
                        f"{batch} (data.batch_size {args.batch_size} x {world_size} processes)")
    return examples // batch


def load_dev_rows(args: GlueDataArgs, tokenizer, n_rows: int) -> torch.Tensor:
    """The whole dev split (n_rows is the loss validation's setting, not used), padded to its longest example."""
    examples, codes = encode_split(args, tokenizer, "dev")
    return pad_rows(examples, codes, tokenizer.pad_id)


def repartition_position(states: list[dict], world_size: int, args: GlueDataArgs) -> list[dict]:
    """Every rank holds the same position: the new ranks continue from it."""
    return [dict(states[0]) for _ in range(world_size)]


def row_shape(args: GlueDataArgs) -> tuple[int, ...]:
    return (1 + args.seq_len,)  # the longest row; batches are as long as their longest example
