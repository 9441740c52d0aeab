"""MTEB tasks built from local files, for machines without the Hugging Face Hub: one or two per task type of the
paper's table that local public data can stand for, scored by mteb's own evaluation. They are stand-ins, good for
comparing models with each other on one machine, not for comparing with published MTEB scores.

`offline_tasks(root)` reads a folder in the layout of the project's shared data (`glue/` in the GLUE TSV layout,
`retrieval/scifact` in BEIR's, `retrieval/sts` and `retrieval/sick` as lingua.eval.sts finds them):

| type               | task                | from                                                                  |
|--------------------|---------------------|-----------------------------------------------------------------------|
| Classification     | SST2Offline         | SST-2: 2,000 train sentences, the dev set as test                     |
| Clustering         | GlueSourceOffline   | 300 dev sentences from each of six GLUE tasks, clustered by their task |
| PairClassification | MRPCOffline         | MRPC dev: paraphrase or not                                           |
| Reranking          | SciFactRerankOffline| SciFact test queries, each over its relevant and 20 BM25 documents     |
| Retrieval          | SciFactOffline      | SciFact test, over the whole corpus                                   |
| STS                | STSBOffline, SICKROffline | STS Benchmark test, SICK test                                   |

Summarization has no local stand-in. A task whose files are missing is left out, with a warning.
"""

import logging
import random
from pathlib import Path

from datasets import Dataset, DatasetDict
from mteb import TaskMetadata
from mteb.abstasks import AbsTask, AbsTaskClassification, AbsTaskClustering, AbsTaskRetrieval, AbsTaskSTS
from mteb.abstasks.pair_classification import AbsTaskPairClassification
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

from lingua.errors import UserError
from lingua.eval.glue_data import TASKS, MissingSplit, load_split
from lingua.eval.retrieval import load_beir
from lingua.eval.sts import find_sts_sets
from lingua.eval.triplets import bm25_search

logger = logging.getLogger(__name__)

CLASSIFICATION_TRAIN = 2000  # SST-2 train sentences the classifier learns from (mteb subsamples them per label)
CLUSTER_SOURCES = ("sst2", "cola", "rte", "mrpc", "qnli", "stsb")
PER_SOURCE = 300
RERANK_CANDIDATES = 20
SEED = 0


def _metadata(name: str, kind: str, main_score: str, description: str) -> TaskMetadata:
    return TaskMetadata(
        name=name, type=kind, main_score=main_score, description=description,
        reference="https://github.com/embeddings-benchmark/mteb", dataset={"path": "local", "revision": "local"},
        category="t2t", eval_splits=["test"], eval_langs=["eng-Latn"], date=("2000-01-01", "2020-01-01"),
        dialect=["Written"], domains=[], task_subtypes=[], license="not specified", annotations_creators="derived",
        modalities=["text"], sample_creation="found", bibtex_citation="")


class _Loaded:
    """A task whose data is given at construction: mteb's `load_data` only marks it loaded."""

    def load_data(self, num_proc=None, **kwargs):
        self.data_loaded = True


def _sample(items: list, n: int) -> list:
    return random.Random(SEED).sample(items, min(n, len(items)))


def classification(glue: Path) -> AbsTask:
    full_train, dev = (load_split(TASKS["sst2"], split, str(glue)) for split in ("train", "dev"))
    train = _sample(list(zip(full_train.texts, full_train.labels.tolist())), CLASSIFICATION_TRAIN)

    class SST2Offline(_Loaded, AbsTaskClassification):
        metadata = _metadata("SST2Offline", "Classification", "accuracy", "SST-2 sentiment, local files.")

    result = SST2Offline()
    result.dataset = DatasetDict({
        "train": Dataset.from_dict({"text": [t[0] for t, _ in train], "label": [y for _, y in train]}),
        "test": Dataset.from_dict({"text": [t[0] for t in dev.texts], "label": dev.labels.tolist()})})
    return result


def clustering(glue: Path) -> AbsTask:
    sentences, labels = [], []
    for name in CLUSTER_SOURCES:
        texts = [text[0] for text in _sample(load_split(TASKS[name], "dev", str(glue)).texts, PER_SOURCE)]
        sentences += texts
        labels += [name] * len(texts)

    class GlueSourceOffline(_Loaded, AbsTaskClustering):
        metadata = _metadata("GlueSourceOffline", "Clustering", "v_measure",
                             "Sentences of six GLUE datasets, clustered by dataset.")
        max_fraction_of_documents_to_embed = None

    result = GlueSourceOffline()
    result.dataset = DatasetDict({"test": Dataset.from_dict({"sentences": sentences, "labels": labels})})
    return result


def pair_classification(glue: Path) -> AbsTask:
    dev = load_split(TASKS["mrpc"], "dev", str(glue))

    class MRPCOffline(_Loaded, AbsTaskPairClassification):
        metadata = _metadata("MRPCOffline", "PairClassification", "max_ap", "MRPC paraphrase pairs, local files.")

    result = MRPCOffline()
    result.dataset = DatasetDict({"test": Dataset.from_dict({
        "sentence1": [a for a, _ in dev.texts], "sentence2": [b for _, b in dev.texts],
        "labels": dev.labels.tolist()})})
    return result


def _retrieval_split(corpus: dict, queries: dict, qrels: dict, top_ranked: dict | None) -> RetrievalSplitData:
    return RetrievalSplitData(
        corpus=Dataset.from_list([{"id": doc, "title": "", "text": text} for doc, text in corpus.items()]),
        queries=Dataset.from_list([{"id": query, "text": text} for query, text in queries.items()]),
        relevant_docs={query: dict(docs) for query, docs in qrels.items()}, top_ranked=top_ranked)


def retrieval(scifact: Path) -> list[AbsTask]:
    corpus, queries, qrels = load_beir(scifact, "test")

    class SciFactOffline(_Loaded, AbsTaskRetrieval):
        metadata = _metadata("SciFactOffline", "Retrieval", "ndcg_at_10", "SciFact claims over its abstracts.")

    class SciFactRerankOffline(_Loaded, AbsTaskRetrieval):
        metadata = _metadata("SciFactRerankOffline", "Reranking", "map_at_1000",
                             "SciFact claims, each over its relevant abstracts and 20 BM25 ones.")

    full = SciFactOffline()
    full.dataset = {"default": {"test": _retrieval_split(corpus, queries, qrels, None)}}
    ranking = bm25_search(queries, corpus, RERANK_CANDIDATES, exclude_self=False)
    candidates = {query: list(dict.fromkeys([*qrels[query], *ranking[query]])) for query in queries}
    kept = {doc for docs in candidates.values() for doc in docs}
    rerank = SciFactRerankOffline()
    rerank.dataset = {"default": {"test": _retrieval_split({d: t for d, t in corpus.items() if d in kept}, queries,
                                                           qrels, candidates)}}
    return [full, rerank]


def sts(root: Path) -> list[AbsTask]:
    found = find_sts_sets(root)
    tasks = []
    for name, label, low, high in (("STSBenchmark/test", "STSBOffline", 0, 5), ("SICK/test", "SICKROffline", 1, 5)):
        if name not in found:
            logger.warning(f"offline MTEB: no {name} under {root}, left out")
            continue
        pairs = found[name]
        cls = type(label, (_Loaded, AbsTaskSTS), {
            "metadata": _metadata(label, "STS", "cosine_spearman", f"{name}, local files."),
            "min_score": low, "max_score": high})
        task = cls()
        task.dataset = DatasetDict({"test": Dataset.from_dict({
            "sentence1": [a for a, _, _ in pairs], "sentence2": [b for _, b, _ in pairs],
            "score": [s for _, _, s in pairs]})})
        tasks.append(task)
    return tasks


def offline_tasks(root: str | Path, names: list[str] | tuple[str, ...] = ()) -> list[AbsTask]:
    """The stand-in tasks whose files are under `root`, in the paper's column order; only `names` if given."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"offline MTEB data: {root} is not a folder")
    builders = [(classification, root / "glue"), (clustering, root / "glue"), (pair_classification, root / "glue"),
                (retrieval, root / "retrieval" / "scifact"), (sts, root / "retrieval")]
    tasks: list[AbsTask] = []
    for build, folder in builders:
        try:
            built = build(folder)
        except (MissingSplit, FileNotFoundError, UserError) as e:
            logger.warning(f"offline MTEB: {build.__name__} left out: {e}")
            continue
        tasks += built if isinstance(built, list) else [built]
    if not tasks:
        raise UserError(f"offline MTEB data: no task's files under {root} (glue/, retrieval/scifact, retrieval/sts)")
    unknown = sorted(set(names) - {task.metadata.name for task in tasks})
    if unknown:
        raise UserError(f"offline MTEB task '{unknown[0]}' is not among those built from {root} "
                        f"({', '.join(task.metadata.name for task in tasks)})")
    return [task for task in tasks if not names or task.metadata.name in names]
