"""The training step's hot path before and after issue 43, side by side in one process, taking turns: BERT and
CrossBERT with the eager output head and foreach AdamW (before) against the compiled head and fused AdamW (after),
at a benchmark preset's shapes on this machine's device. Prints, per app and path, the median step time and
steps/s over the timed steps, the share of the step the profiler names `head+loss` (one profiled step each), and
the head's own peak memory (CrossBERT's predictions of one step at the preset's width, one chunk, forward and
backward; the profiler's memory timeline).

    python scripts/hot_path_speed.py [preset=cpu|paper|debug] [steps=3] [rounds=2]
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingua.model.masking import chunked_lm_loss  # noqa: E402
from lingua.training.optim import OptimArgs, build_optimizer  # noqa: E402
from tools.benchmark import build, parse_args, step  # noqa: E402

PATHS = {"before": ("eager", "foreach"), "after": ("compiled", "fused")}


def head_peak_mib(head_loss: str, rows: int, dim: int, vocab: int, chunk: int) -> float:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, dim, generator=g, requires_grad=True)
    w = (torch.randn(vocab, dim, generator=g) / 20).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    chunked_lm_loss(h, w, targets, chunk, None, head_loss)[0].backward()  # compiled outside the profile
    with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        chunked_lm_loss(h, w, targets, chunk, None, head_loss)[0].backward()
    with tempfile.TemporaryDirectory() as folder:
        timeline = Path(folder) / "memory.json"
        prof.export_memory_timeline(str(timeline), device="cpu")
        _, sizes = json.loads(timeline.read_text())
    return max(map(sum, sizes)) / 2**20


def main(argv: list[str]) -> None:
    settings = dict(arg.split("=", 1) for arg in argv)
    steps, rounds = int(settings.pop("steps", 3)), int(settings.pop("rounds", 2))
    args = parse_args([f"{key}={value}" for key, value in settings.items()] + ["warmup=1"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    contenders = {}
    for app in ("bert", "crossbert"):
        for when, (head_loss, implementation) in PATHS.items():
            contender = build(f"{app}+encoder.head_loss={head_loss}", args, device)  # one warm-up step: compiles
            contender.optimizer = build_optimizer(contender.model, OptimArgs(implementation=implementation))
            step(contender, args, device)  # the new optimizer's first step (its state) is not timed
            contenders[app, when] = contender
    times = {key: [] for key in contenders}
    for _ in range(rounds):
        for key, contender in contenders.items():
            times[key] += [step(contender, args, device) for _ in range(steps)]
    for (app, when), contender in contenders.items():
        with profile() as prof:
            wall = step(contender, args, device)
        head = sum(e.cpu_time_total for e in prof.events() if e.name == "head+loss") / 1e6
        median = statistics.median(times[app, when])
        print(f"{app} {when} ({'+'.join(PATHS[when])}): median step {median * 1e3:,.0f} ms "
              f"({1 / median:.3f} steps/s, {len(times[app, when])} steps); profiled step: head+loss "
              f"{head / wall:.1%}")
    rows = args.batch_size * args.seq_len  # CrossBERT predicts every token of a row (its two CMS views)
    for when, (head_loss, _) in PATHS.items():
        peak = head_peak_mib(head_loss, min(rows, args.encoder.head_chunk or rows), args.encoder.dim,
                             args.vocab_size, args.encoder.head_chunk or rows)
        print(f"head {when} ({head_loss}): peak memory {peak:,.0f} MiB for one chunk, forward and backward")


if __name__ == "__main__":
    main(sys.argv[1:])
