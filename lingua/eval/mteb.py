"""MTEB, the Massive Text Embedding Benchmark, on this library's sentence embeddings
(`lingua.export.embedder.Embedder`).

`MtebEncoder` presents an Embedder to mteb as an encoder (its `EncoderProtocol`): every input, query or document,
goes through the same `encode`, with no instruction or prompt, as in the paper. `run_mteb` evaluates a benchmark, or
some tasks, with mteb's own evaluation code and returns each task's main score; `summarize` averages them into the
paper's table: one column per task type, then "Avg." (the mean of those columns) and "Overall" (the mean over all
tasks). Scores here are in %; mteb's result files keep its own 0-1 scale. The task data comes from the Hugging Face
Hub (or its local cache).
"""

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import mteb
import numpy as np
from datasets.exceptions import DatasetNotFoundError
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from mteb.abstasks import AbsTask
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction

from lingua.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_BENCHMARK = "MTEB(eng, v2)"
# the paper's columns, in its order; mteb 2.x names its task types the same way
CATEGORIES = ("Classification", "Clustering", "PairClassification", "Reranking", "Retrieval", "STS", "Summarization")
# what loading a task's data raises when the Hub cannot be reached: `datasets` turns network failures and offline
# mode into ConnectionError; the Hub client's own errors cover a download failing half-way or a gated dataset
HUB_ERRORS = (ConnectionError, HfHubHTTPError, LocalEntryNotFoundError, DatasetNotFoundError)


class MtebEncoder(AbsEncoder):
    """An Embedder as mteb's encoder. Embeddings are L2-normalised, so mteb's cosine similarity is their dot product."""

    def __init__(self, embedder):
        self.model = embedder
        name = embedder.name if "/" in embedder.name else f"lingua/{embedder.name}"  # mteb wants 'org/model'
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": name, "embed_dim": embedder.dim, "similarity_fn_name": ScoringFunction.COSINE,
            "framework": ["PyTorch"], "use_instructions": False,
        })

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs) -> np.ndarray:
        """[N, D] float32 embeddings of the texts of mteb's DataLoader, in its order. The task, split, subset and
        prompt type (query or document) change nothing: the paper encodes every text alike, without prompts. A
        document's text is already its title and body joined by mteb."""
        texts = [text for batch in inputs for text in batch["text"]]
        return self.model.encode(texts, batch_size=kwargs.get("batch_size", 32)).numpy()


def select_tasks(benchmark: str = DEFAULT_BENCHMARK, names: Sequence[str] = ()) -> list[AbsTask]:
    """The benchmark's tasks, or the named ones: a task of the benchmark keeps its splits and language subsets (e.g.
    STS17 en-en only in an English benchmark); any other task is taken whole."""
    try:
        tasks = {task.metadata.name: task for task in mteb.get_benchmark(benchmark).tasks}
    except KeyError as e:
        raise UserError(f"MTEB benchmark {e.args[0]}") from None
    if not names:
        return list(tasks.values())
    selected = []
    for name in names:
        if name in tasks:
            selected.append(tasks[name])
            continue
        try:
            selected.append(mteb.get_task(name))
        except KeyError as e:
            raise UserError(f"MTEB task {e.args[0].removeprefix('KeyError: ')}") from None
        logger.info(f"{name} is not in {benchmark}: all its splits and language subsets are evaluated")
    return selected


def run_mteb(embedder, tasks: Sequence[str] | Sequence[AbsTask] = (), benchmark: str = DEFAULT_BENCHMARK,
             results_dir: str | Path | None = None, batch_size: int = 32, overwrite: bool = False) -> dict[str, dict]:
    """{task name: {"type", "metric", "score" (%)}} of `embedder` on `tasks`, in order: task names (resolved by
    `select_tasks`; none: the whole benchmark) or task objects. mteb writes its result files under `results_dir`
    (None: no files) and, unless `overwrite`, reuses those already there, so an interrupted run resumes where it
    stopped. A task whose data cannot be downloaded is a UserError naming it."""
    if all(isinstance(task, str) for task in tasks):
        tasks = select_tasks(benchmark, tasks)
    encoder = MtebEncoder(embedder)
    cache = mteb.ResultCache(results_dir) if results_dir is not None else None
    scores = {}
    for i, task in enumerate(tasks, 1):
        name, task_type = task.metadata.name, task.metadata.type
        logger.info(f"MTEB task {i}/{len(tasks)}: {name} ({task_type})")
        start = time.monotonic()
        result = _evaluate(encoder, task, cache, batch_size, overwrite)
        # mean over the task's splits and subsets, as mteb's leaderboard scores a task
        score = 100 * float(result.validate_and_filter_scores(task).get_score())
        scores[name] = {"type": task_type, "metric": task.metadata.main_score, "score": score}
        logger.info(f"{name}: {task.metadata.main_score} {score:.2f} ({time.monotonic() - start:.0f} s)")
    return scores


def _evaluate(encoder: MtebEncoder, task: AbsTask, cache, batch_size: int, overwrite: bool):
    try:
        results = mteb.evaluate(encoder, task, cache=cache, encode_kwargs={"batch_size": batch_size},
                                overwrite_strategy="always" if overwrite else "only-missing",
                                co2_tracker=False, show_progress_bar=False)
    except HUB_ERRORS as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot get the data of MTEB task {task.metadata.name} from the Hugging Face Hub ({reason}): "
                        "MTEB needs network access, or the datasets already in the Hugging Face cache") from None
    if results.exceptions:  # mteb reports some failures (a private dataset out of reach) instead of raising
        raise UserError(f"MTEB task {task.metadata.name} failed: {results.exceptions[0].exception}")
    return results.task_results[0]


def summarize(scores: dict[str, dict]) -> dict[str, float]:
    """The paper's table from `run_mteb`'s scores: the mean score of each task type present (the paper's categories
    in its order, then any other type), "Avg." the mean of those means and "Overall" the mean over all tasks."""
    by_type: dict[str, list[float]] = {}
    for task in scores.values():
        by_type.setdefault(task["type"], []).append(task["score"])
    order = [c for c in CATEGORIES if c in by_type] + sorted(set(by_type) - set(CATEGORIES))
    summary = {category: float(np.mean(by_type[category])) for category in order}
    summary["Avg."] = float(np.mean(list(summary.values())))
    summary["Overall"] = float(np.mean([task["score"] for task in scores.values()]))
    return summary


def format_table(scores: dict[str, dict], summary: dict[str, float], model: str) -> str:
    """One row per task (type, metric, score), then the paper's layout: the categories, Avg. and Overall."""
    width = max([len(name) for name in scores] + [4])
    lines = [f"{'task':<{width}}  {'type':<18}  {'metric':<32}  {'score':>6}"]
    lines += [f"{name:<{width}}  {t['type']:<18}  {t['metric']:<32}  {t['score']:>6.2f}" for name, t in scores.items()]
    columns = [*CATEGORIES, *(c for c in summary if c not in CATEGORIES)]  # the paper's columns, even if empty
    label, widths = max(len(model), 5), [max(len(c), 6) + 2 for c in columns]
    lines += ["", f"MTEB, scores in % ({len(scores)} tasks)",
              f"{'model':<{label}}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths)),
              f"{model:<{label}}" + "".join(f"{summary[c]:>{w}.2f}" if c in summary else f"{'-':>{w}}"
                                            for c, w in zip(columns, widths))]
    return "\n".join(lines)
