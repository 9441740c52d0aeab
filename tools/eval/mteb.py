"""MTEB evaluation of a checkpoint's sentence embeddings (mteb's own evaluation, no prompts, as in the paper):

    python -m tools.eval.mteb ckpt=DUMP_DIR_OR_CHECKPOINT [benchmark="MTEB(eng, v2)"] [tasks=STS12,SciFact]
        [batch_size=32] [device=auto] [pooling=auto] [max_len=0] [out=DIR] [overwrite=false] [offline=DATA_DIR]
        [app=NAME]

Prints each task's main score, then the paper's table (one column per task type, Avg. = their mean, Overall = the
mean over tasks). Writes mteb's result files under OUT/results/ and the summary, OUT/results.json; OUT defaults to
DUMP_DIR/mteb_eval/<checkpoint name>/. Tasks whose results are already in OUT are not run again (an interrupted run
resumes), unless overwrite=true. The task data comes from the Hugging Face Hub, or its cache (HF_HOME);
`offline=DATA_DIR` runs instead the stand-in tasks of lingua/eval/mteb_offline.py, built from local files (one or
two per task type; `tasks=` picks among them).
Needs `pip install mteb==2.26.24`.
"""

import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lingua.args import command_line, load_config
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError, at_least
from lingua.files import untrusted
from lingua.files.safe import atomic_write
from lingua.metrics import setup_logging
from lingua.run_folder import RESULTS, RunFolder


@dataclass
class MtebCommandArgs:
    ckpt: str = ""  # a run's dump_dir (its newest checkpoint, else consolidated.pt), a checkpoint folder or a .pt file
    benchmark: str = "MTEB(eng, v2)"  # an mteb benchmark name
    tasks: list[str] = field(default_factory=list)  # task names (default: the whole benchmark)
    batch_size: int = 32  # texts per forward pass
    device: str = "auto"  # auto: cuda if available, else cpu
    pooling: str = "auto"  # auto: the model's trained pooler if it has one, else mean | mean: always the mean
    max_len: int = 0  # tokens per text; 0: the length the model was trained on
    out: str = ""  # results folder; default DUMP_DIR/mteb_eval/<checkpoint name>/
    overwrite: bool = False  # run again the tasks whose results are already in out
    offline: str = ""  # a folder of local data (glue/, retrieval/): its stand-in tasks instead of the benchmark
    app: str = ""  # ckpt's app when not one of this code's (e.g. my_pkg.my_app): trusted to rebuild it

    def __post_init__(self):
        at_least(self, 1, "batch_size")
        at_least(self, 0, "max_len")


def read_results(path: Path) -> dict:
    """A results.json of this command, its args (the benchmark, the tasks, offline) and summary checked: a file of
    another shape (copied, edited) is one line naming it."""
    results = untrusted.read_json(path, "MTEB results")
    args, summary = results.get("args"), results.get("summary")
    if not (isinstance(args, dict) and isinstance(args.get("benchmark"), str)
            and isinstance(args.get("tasks", []), list) and all(isinstance(t, str) for t in args.get("tasks", []))
            and isinstance(summary, dict) and all(isinstance(score, (int, float)) for score in summary.values())):
        raise UserError(f"MTEB results {path} hold no benchmark, tasks and summary of scores")
    return results


def benchmark_of(results: dict) -> str:
    """What a results.json of this command scored: "offline stand-ins", the benchmark's name when it ran the whole
    benchmark, or the benchmark's name and the tasks it ran (`tasks=`), so that a subset is never taken for it."""
    args = results["args"]
    if args.get("offline"):
        return "offline stand-ins"
    return f"{args['benchmark']}: {', '.join(args['tasks'])}" if args.get("tasks") else args["benchmark"]


def output_dir(args: MtebCommandArgs) -> Path:
    if args.out:
        return Path(args.out)
    checkpoint = Checkpoint.open(args.ckpt).path
    return RunFolder.of(checkpoint).evaluation("mteb", checkpoint)


def run(args: MtebCommandArgs) -> dict:
    if not args.ckpt:
        raise UserError("ckpt= is required: a consolidated.pt, a checkpoint folder or a run's dump_dir")
    if importlib.util.find_spec("mteb") is None:
        raise UserError("the mteb package is not installed: pip install mteb==2.26.24")
    from lingua.eval.mteb import format_table, run_mteb, select_tasks, summarize
    from lingua.eval.mteb_offline import offline_tasks
    from lingua.export.embedder import load_embedder

    tasks = offline_tasks(args.offline, args.tasks) if args.offline else select_tasks(args.benchmark, args.tasks)
    out = output_dir(args)
    try:
        out.mkdir(parents=True, exist_ok=True)  # now, not after hours of evaluation
    except OSError as e:
        raise UserError(f"cannot create {out}: {e.strerror}") from None
    embedder = load_embedder(args.ckpt, device=args.device, pooling=args.pooling, max_len=args.max_len,
                             app=args.app or None)
    scores = run_mteb(embedder, tasks, results_dir=out, batch_size=args.batch_size, overwrite=args.overwrite)
    results = {"checkpoint": args.ckpt, "model": embedder.name, "args": asdict(args), "tasks": scores,
               "summary": summarize(scores)}
    path = out / RESULTS
    try:
        atomic_write(path, json.dumps(results, indent=1))
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    print(format_table(scores, results["summary"], embedder.name))
    print(f"results: {path}")
    return results


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(MtebCommandArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        run(args)


if __name__ == "__main__":
    main()
