"""Batch-size warm-up: the global batch grows from a start size to its target over the run's first tokens.

It grows by gradient accumulation: an optimizer step accumulates `start`, then `2·start`, ... up to `grad_acc_steps`
micro-batches, each of the same shape (`data.batch_size` rows of `data.seq_len` on every rank). Growing the rows of
one micro-batch instead would change the shapes the model sees: each new size recompiles the compiled blocks, changes
CrossBERT's packed CMS rows and the attention kernels' shapes, and makes the memory check (sized on one micro-batch)
hold only for the largest. Accumulated micro-batches average to the same gradient as one batch of all their rows.

The count is a pure function of the data tokens the run has trained on (`TrainState.data_tokens`, saved with every
checkpoint, the same on every rank), so a resumed run takes the same steps as one never interrupted, and a resume on
another number of processes keeps the ramp in tokens.
"""

from dataclasses import dataclass

from lingua.errors import at_least, require


@dataclass
class BatchWarmupArgs:
    start: int = 0  # micro-batches per optimizer step at the run's start, growing to grad_acc_steps; 0: no warm-up
    tokens: int = 0  # data tokens (all processes) over which the batch grows from `start` to grad_acc_steps

    def __post_init__(self):
        at_least(self, 0, "start", "tokens")
        require(self.start == 0 or self.tokens > 0, "tokens", "must be > 0 when batch_warmup.start is set: the "
                "data tokens over which the batch grows")


def check_batch_warmup(args: BatchWarmupArgs, grad_acc_steps: int) -> None:
    """The warm-up's start divides its target, so every stage is a whole number of micro-batches."""
    require(args.start == 0 or grad_acc_steps % args.start == 0, "batch_warmup.start",
            f"must divide grad_acc_steps ({grad_acc_steps}), the batch it grows to, got {args.start}")


def micro_batches_at(args: BatchWarmupArgs, grad_acc_steps: int, data_tokens: int) -> int:
    """Micro-batches of the optimizer step that starts after `data_tokens` data tokens: `start·k` for the k-th of the
    `grad_acc_steps / start - 1` equal shares of `args.tokens`, then `grad_acc_steps` from `args.tokens` on."""
    if args.start == 0 or data_tokens >= args.tokens:
        return grad_acc_steps
    stages = grad_acc_steps // args.start
    return args.start * (1 + (stages - 1) * data_tokens // args.tokens)
