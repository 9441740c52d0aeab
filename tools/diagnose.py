"""How fast BERT and CrossBERT learn controlled masked-token tasks, side by side (a minute on a CPU):
    python -m tools.diagnose task=pairs apps=bert,crossbert+cms=false+mask_ratio=0.2 [steps=300] [key=value ...]

Sequences of random bytes (the byte tokenizer's vocabulary) built so that a masked token is determined by others:
- `pairs`: every byte written twice ("xxyyzz..."): the answer is the partner, one place to the left or right;
- `period`: a random block of `period` bytes repeated: the answer is `period` places away (period=1: one byte
  repeated, where content alone answers and no position is needed);
Prints the accuracy on a fixed held-out batch every `every` steps, one column per app (`app+key=value` changes
one app's model, as in tools/benchmark.py); `out=FILE.json` also writes the curves.
"""

import json
import logging
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from lingua.app import app_variant, build_model
from lingua.args import command_line, load_config, to_dict
from lingua.errors import at_least, require
from lingua.files.safe import atomic_write
from lingua.metrics import setup_logging
from lingua.model.transformer import TransformerArgs
from lingua.training.optim import OptimArgs, build_optimizer, lr_at, set_lr
from lingua.training.step import training_step

logger = logging.getLogger(__name__)
TASKS = ("pairs", "period")
BYTES = 256  # the task's tokens; the four special tokens follow, as in the byte tokenizer
VOCAB = BYTES + 4


def small_encoder() -> TransformerArgs:
    return TransformerArgs(dim=128, n_layers=4, n_heads=4, max_seqlen=64)


@dataclass
class DiagnoseArgs:
    task: str = "pairs"  # pairs | period
    period: int = 4  # task=period: the length of the repeated block
    apps: str = "bert,crossbert+cms=false+mask_ratio=0.2"  # the same task for both: 20% masked, one view
    encoder: TransformerArgs = field(default_factory=small_encoder)
    seq_len: int = 64  # bytes per sequence
    batch_size: int = 32  # sequences per step
    steps: int = 300  # training steps per app
    every: int = 50  # steps between accuracy measurements
    eval_sequences: int = 256  # held-out sequences for the accuracy
    optim: OptimArgs = field(default_factory=lambda: OptimArgs(lr=2e-3, warmup=30, lr_min=2e-4))
    seed: int = 0  # model init, data and masking
    out: str = ""  # also write the curves here as JSON

    def __post_init__(self):
        require(self.task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got '{self.task}'")
        at_least(self, 1, "period", "batch_size", "steps", "every", "eval_sequences")
        at_least(self, 2, "seq_len")
        require(self.seq_len <= self.encoder.max_seqlen, "seq_len",
                f"{self.seq_len} exceeds encoder.max_seqlen {self.encoder.max_seqlen}")


def make_sequences(task: str, period: int, n: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[n, seq_len] byte sequences of the task."""
    if task == "pairs":
        halves = torch.randint(0, BYTES, (n, (seq_len + 1) // 2), generator=generator)
        return halves.repeat_interleave(2, 1)[:, :seq_len]
    block = torch.randint(0, BYTES, (n, period), generator=generator)
    return block.repeat(1, -(-seq_len // period))[:, :seq_len]


def learning_curve(label: str, args: DiagnoseArgs) -> list[float]:
    """Held-out masked-token accuracy after every `every` training steps."""
    app, model_args = app_variant(label, {"encoder": to_dict(args.encoder)})
    model = build_model(app.build_model, model_args, SimpleNamespace(vocab_size=VOCAB, mask_id=VOCAB - 1),
                        torch.device("cpu"), args.seed)
    optimizer = build_optimizer(model, args.optim)
    data, masking = (torch.Generator().manual_seed(args.seed + i) for i in (1, 2))
    held_out = make_sequences(args.task, args.period, args.eval_sequences, args.seq_len,
                              torch.Generator().manual_seed(args.seed + 3))
    curve = []
    for step in range(args.steps):
        set_lr(optimizer, lr_at(step, args.optim, args.steps))
        tokens = make_sequences(args.task, args.period, args.batch_size, args.seq_len, data)
        training_step(model, optimizer, [model.make_batch(tokens, masking)], args.optim.clip)
        if (step + 1) % args.every == 0:
            curve.append(accuracy(model, held_out, args.seed))
            logger.info(f"{label}: step {step + 1} accuracy {curve[-1]:.3f}")
    return curve


@torch.no_grad()
def accuracy(model, tokens: torch.Tensor, seed: int) -> float:
    model.eval()
    _, stats = model(**model.make_batch(tokens, torch.Generator().manual_seed(seed)))
    model.train()
    return stats["accuracy"].item()


def format_curves(curves: dict[str, list[float]], args: DiagnoseArgs) -> str:
    width = max(len("step"), *(len(label) for label in curves))
    lines = ["step".ljust(6) + "".join(label.rjust(width + 2) for label in curves)]
    for i in range(len(next(iter(curves.values())))):
        values = "".join(f"{c[i]:.3f}".rjust(width + 2) for c in curves.values())
        lines.append(str((i + 1) * args.every).ljust(6) + values)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(DiagnoseArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        labels = [label.strip() for label in args.apps.split(",") if label.strip()]
        curves = {label: learning_curve(label, args) for label in labels}
        task = args.task + (f" (period {args.period})" if args.task == "period" else "")
        print(f"held-out masked-token accuracy, task {task}, chance {1 / BYTES:.3f}")
        print(format_curves(curves, args))
        if args.out:
            atomic_write(args.out, json.dumps({"args": to_dict(args), "every": args.every, "curves": curves}))


if __name__ == "__main__":
    main()
