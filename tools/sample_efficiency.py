"""Appendix B's claim measured: the data tokens a run without CMS and one with CMS need to reach the same frozen GLUE
score ("CMS effectively doubles sample efficiency, requiring half the training data to reach the same performance").

    python -m tools.sample_efficiency runs=DIR/*/pretrain [probe=linear] [task=avg]

Reads the GLUE probe scores each run logged during training (eval.every > 0: the `glue/<task>/<probe>` records) and
the data tokens it had read by then (metrics.jsonl's data_tokens: a sequence counts once, though CMS processes it in
two views). The runs are one without CMS and one with (one or two views per token, from their throughput records).
For each score the run without CMS logged that the run with CMS also reached, it prints the data tokens each needed
first to reach it (linearly interpolated between probe points) and their ratio, without over with; then the median
ratio beside the paper's 2. The pipeline: docs/pipelines/appendix_b.yaml.
"""

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from lingua.args import command_line, load_config
from lingua.errors import UserError
from tools import paper
from tools.scaling_runs import read_run, require_probe, run_dirs


@dataclass
class EfficiencyArgs:
    runs: str = ""  # the two pre-training runs' folders (a pattern: DIR/*/pretrain), one without CMS, one with
    probe: str = "linear"  # linear | knn
    task: str = "avg"  # the GLUE average, or one task (sst2, ...)

    def __post_init__(self):
        require_probe(self.probe)


def tokens_to_reach(curve: list[tuple[float, float]], level: float) -> float | None:
    """The data tokens at which a (tokens, score) curve first reaches `level`, linearly interpolated between the two
    probe points around it; None if it never does."""
    previous = None
    for tokens, score in curve:
        if score >= level:
            if previous is None or previous[1] >= score:
                return tokens
            (t0, s0) = previous
            return t0 + (tokens - t0) * (level - s0) / (score - s0)
        previous = (tokens, score)
    return None


def efficiency_rows(without: list[tuple[float, float]], with_cms: list[tuple[float, float]]
                    ) -> list[tuple[float, float, float, float]]:
    """(score, tokens without CMS, tokens with CMS, their ratio) for each score the run without CMS logged that the
    run with CMS reached too."""
    rows = []
    for level in dict.fromkeys(score for _, score in without):
        off, on = tokens_to_reach(without, level), tokens_to_reach(with_cms, level)
        if on:
            rows.append((level, off, on, off / on))
    return rows


def token_curve(run: dict[str, Any], probe: str, task: str) -> list[tuple[float, float]]:
    """(data tokens read, score) of the run's logged probe scores of `task`, the tokens those the loop had counted by
    the probe's step."""
    key = f"glue/{task}/{probe}"
    return [(run["data_tokens_at"](record["step"]), record[key]) for _, record in run["probe_curve"] if key in record]


def format_efficiency(runs: list[dict[str, Any]], probe: str, task: str) -> str:
    by_views = {views: [run for run in runs if run["views_per_token"] == views] for views in (1, 2)}
    if len(by_views[1]) != 1 or len(by_views[2]) != 1:
        raise UserError(f"one run without CMS and one with are needed, found {len(by_views[1])} and "
                        f"{len(by_views[2])} in {', '.join(str(run['dir']) for run in runs)}")
    without, with_cms = (token_curve(by_views[views][0], probe, task) for views in (1, 2))
    if not without or not with_cms:
        raise UserError(f"no glue/{task}/{probe} scores logged during training in both runs (set eval.every > 0)")
    rows = efficiency_rows(without, with_cms)
    lines = [f"| GLUE {task}, {probe} probe | data tokens without CMS | with CMS | ratio |", "|---|---|---|---|"]
    lines += [f"| {level:.1f} | {off / 1e9:.3g}B | {on / 1e9:.3g}B | {ratio:.2f} |" for level, off, on, ratio in rows]
    median = f"{statistics.median(row[3] for row in rows):.2f}" if rows else "none (no score both runs reached)"
    return "\n".join(lines + ["", f"Data tokens without CMS over with CMS to reach the same score, median: ours "
                              f"{median}; the paper (Appendix B): {paper.PROSE['cms_data_ratio']}."])


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(EfficiencyArgs, sys.argv[1:] if argv is None else argv)
        runs = [read_run(folder) for folder in run_dirs(args.runs)]
        print(format_efficiency(runs, args.probe, args.task))


if __name__ == "__main__":
    main()
