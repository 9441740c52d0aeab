"""Contrastive training triplets from a BEIR folder, with hard negatives mined by BM25 or by a sentence embedder, or
from MS MARCO on the HuggingFace hub (the paper's contrastive data; needs `pip install datasets` and the network):

    python -m lingua.eval.triplets beir=FOLDER out=FILE.jsonl [split=train] [n_negatives=7] [miner=bm25] [skip_top=0]
    python -m lingua.eval.triplets hub=msmarco out=FILE.jsonl [n_negatives=7] [max_queries=0]

`hub=msmarco` streams sentence-transformers' MS MARCO with hard negatives mined by msmarco-distilbert-base-tas-b
(config triplet-50: a query, its positive, 50 negatives, one row per query), keeping the first n_negatives; any
other `hub=` dataset with the columns query, positive and negative_1.. (or negatives, a list) works too.

Writes one JSON object per line, one line per (query, positive) pair of the split's qrels (a positive is a judged
document with score > 0), and prints a one-line summary:

    {"query": "...", "positive": "...", "negatives": ["...", ...]}

The negatives of a query are its best-ranked documents once its positives and the document with the query's own id
are left out, after skipping the first `skip_top` of them (likely positives nobody judged); every line has exactly
`n_negatives`, and all lines of one query share them. Texts are as `load_beir` gives them (title + " " + text).

BM25 (Okapi, k1 = 1.5, b = 0.75, Lucene's non-negative idf; lowercase `\\w+` tokens) ranks by score, ties by corpus
order, so the file is the same on every run. Mining with a model is library use:
`build_triplets(folder, miner=embedder)` with any `Embedder` (lingua/eval/retrieval.py) ranks by cosine similarity.
"""

import json
import logging
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import sparse

from lingua.args import command_line, load_config
from lingua.errors import UserError, at_least, require
from lingua.eval.retrieval import Embedder, Qrels, Ranking, dense_search, load_beir, numbered_lines
from lingua.files.safe import atomic_write
from lingua.files.untrusted import parse_json_line
from lingua.metrics import setup_logging

logger = logging.getLogger(__name__)

TOKEN = re.compile(r"\w+")
SCORE_BUDGET = 2**24  # BM25 scores held at once (64 MiB of float32): sets how many queries are ranked together


@dataclass
class Triplet:
    """One line of the file: a query, one of its relevant documents, and documents ranked high but not relevant."""

    query: str
    positive: str
    negatives: list[str]


# ------------------------------------------------------------------------------------------------------ BM25


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


class BM25:
    """Okapi BM25 over a fixed list of documents: score(q, d) = sum over the query's tokens t (a repeated token
    counts again) of idf(t) · tf(t, d) · (k1 + 1) / (tf(t, d) + k1 · (1 − b + b · |d| / avgdl)), with
    idf(t) = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5)) (Lucene's, never negative). Documents are rows of a sparse
    matrix of these per-term weights, so scoring a block of queries is one sparse product."""

    def __init__(self, documents: list[str], k1: float = 1.5, b: float = 0.75):
        self.vocabulary: dict[str, int] = {}
        token_ids = [[self.vocabulary.setdefault(t, len(self.vocabulary)) for t in tokenize(d)] for d in documents]
        counts = self._count_matrix(token_ids)
        lengths = np.array([len(ids) for ids in token_ids], dtype=np.float64)
        doc_freq = np.bincount(counts.indices, minlength=len(self.vocabulary))
        idf = np.log1p((len(documents) - doc_freq + 0.5) / (doc_freq + 0.5))
        # the document of each stored entry; only documents with tokens have entries, so avgdl > 0 where used
        entry_doc = np.repeat(np.arange(len(documents)), np.diff(counts.indptr))
        tf = counts.data
        norm = k1 * (1 - b + b * lengths[entry_doc] / lengths.mean())
        counts.data = idf[counts.indices] * tf * (k1 + 1) / (tf + norm)
        self.term_doc_weights = counts.T.tocsr()  # [vocabulary, documents]

    def _count_matrix(self, token_ids: list[list[int]]) -> sparse.csr_matrix:
        """Term counts, one row per token list, one column per vocabulary entry."""
        indptr = np.cumsum([0] + [len(ids) for ids in token_ids])
        indices = np.fromiter((i for ids in token_ids for i in ids), dtype=np.int64, count=indptr[-1])
        counts = sparse.csr_matrix((np.ones(len(indices)), indices, indptr),
                                   shape=(len(token_ids), len(self.vocabulary)))
        counts.sum_duplicates()
        return counts

    def scores(self, queries: list[str]) -> np.ndarray:
        """[len(queries), documents] BM25 scores; tokens absent from the documents add nothing."""
        token_ids = [[self.vocabulary[t] for t in tokenize(q) if t in self.vocabulary] for q in queries]
        return (self._count_matrix(token_ids) @ self.term_doc_weights).toarray()


def bm25_search(queries: dict[str, str], corpus: dict[str, str], top_k: int, exclude_self: bool = True) -> Ranking:
    """The `top_k` documents of highest BM25 score per query, best first, ties in corpus order; the document whose
    id is the query's is left out (exclude_self)."""
    start_time = time.perf_counter()
    index = BM25(list(corpus.values()))
    doc_ids = list(corpus)
    doc_index = {doc_id: i for i, doc_id in enumerate(doc_ids)}
    query_ids = list(queries)
    block = max(1, SCORE_BUDGET // len(doc_ids))
    ranking = {}
    for start in range(0, len(query_ids), block):
        block_ids = query_ids[start:start + block]
        for query_id, scores in zip(block_ids, index.scores([queries[q] for q in block_ids])):
            if exclude_self and query_id in doc_index:
                scores[doc_index[query_id]] = -math.inf
            ranking[query_id] = [doc_ids[i] for i in top_indices(scores, top_k) if scores[i] > -math.inf]
    logger.info(f"BM25: ranked {len(query_ids)} queries over {len(doc_ids)} documents in "
                f"{time.perf_counter() - start_time:.1f}s")
    return ranking


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k highest scores, highest first, ties by index, without sorting the whole row."""
    k = min(k, len(scores))
    threshold = np.partition(scores, len(scores) - k)[len(scores) - k]  # the k-th highest score
    candidates = np.flatnonzero(scores >= threshold)
    return candidates[np.lexsort((candidates, -scores[candidates]))][:k]


# ------------------------------------------------------------------------------------------------------ triplets


def build_triplets(folder: str | Path, split: str = "train", n_negatives: int = 7, miner: str | Embedder = "bm25",
                   skip_top: int = 0, batch_size: int = 32) -> dict[str, list[Triplet]]:
    """{query id: its triplets} of a BEIR folder's split (queries in queries.jsonl's order), negatives mined with
    BM25 (miner="bm25") or an embedder."""
    if n_negatives < 1 or skip_top < 0:
        raise UserError(f"need n_negatives >= 1 and skip_top >= 0, got {n_negatives} and {skip_top}")
    if isinstance(miner, str) and miner != "bm25":
        raise UserError(f"unknown miner {miner!r}: 'bm25', or an embedder object")
    corpus, queries, qrels = load_beir(folder, split)
    positives = {q: [doc_id for doc_id, grade in qrels[q].items() if grade > 0] for q in queries}
    queries = {q: text for q, text in queries.items() if positives[q]}
    if not queries:
        raise UserError(f"{folder}: no query of the {split} split has a positive document (qrels score > 0)")
    depth = skip_top + n_negatives + max(len(positives[q]) for q in queries)
    if isinstance(miner, str):
        ranking = bm25_search(queries, corpus, depth)
    else:
        ranking = dense_search(miner, queries, corpus, depth, batch_size)
    return triplets_from_ranking(corpus, queries, qrels, ranking, n_negatives, skip_top)


def triplets_from_ranking(corpus: dict[str, str], queries: dict[str, str], qrels: Qrels, ranking: Ranking,
                          n_negatives: int, skip_top: int) -> dict[str, list[Triplet]]:
    """One triplet per (query, positive), the negatives the query's best-ranked non-positives after `skip_top`."""
    triplets = {}
    for query_id, query in queries.items():
        positives = [doc_id for doc_id, grade in qrels[query_id].items() if grade > 0]
        others = [doc_id for doc_id in ranking[query_id] if doc_id not in positives]
        negatives = others[skip_top:skip_top + n_negatives]
        if len(negatives) < n_negatives:
            raise UserError(f"query {query_id!r}: only {len(negatives)} negatives after skip_top={skip_top}, "
                            f"need n_negatives={n_negatives} (the corpus has {len(corpus)} documents)")
        triplets[query_id] = [Triplet(query, corpus[doc_id], [corpus[n] for n in negatives]) for doc_id in positives]
    return triplets


def write_triplets(path: str | Path, triplets: list[Triplet]) -> None:
    """The triplets as JSONL, written atomically (a reader never sees half a file)."""
    def write(f) -> None:
        for triplet in triplets:
            f.write((json.dumps(asdict(triplet), ensure_ascii=False) + "\n").encode())
    try:
        atomic_write(path, write)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None


def read_triplets(path: str | Path) -> list[Triplet]:
    """The triplets of a JSONL file in the format above, every line checked (blank lines ignored)."""
    triplets = [_parse_triplet(path, line_no, line) for line_no, line in numbered_lines(path) if line.strip()]
    if not triplets:
        raise UserError(f"{path} holds no triplet")
    return triplets


def _parse_triplet(path: str | Path, line_no: int, line: str) -> Triplet:
    record = parse_json_line(path, line_no, line)
    for key in ("query", "positive"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise UserError(f"{path}:{line_no}: '{key}' must be a non-empty string, got {record.get(key)!r}")
    negatives = record.get("negatives")
    if not isinstance(negatives, list) or not all(isinstance(n, str) for n in negatives):
        raise UserError(f"{path}:{line_no}: 'negatives' must be a list of strings")
    return Triplet(record["query"], record["positive"], negatives)


# ------------------------------------------------------------------------------------------------------ command


MSMARCO = ("sentence-transformers/msmarco-msmarco-distilbert-base-tas-b", "triplet-50")


def hub_rows(dataset: str, config: str):
    """The rows of a hub dataset's train split, streamed."""
    try:
        import datasets
    except ImportError:
        raise UserError("hub= needs the HuggingFace `datasets` package (pip install datasets)") from None
    try:
        return datasets.load_dataset(dataset, config or None, split="train", streaming=True)
    except Exception as e:  # network, hub or cache errors of any kind
        raise UserError(f"cannot load {dataset} from the hub: {str(e).splitlines()[0] if str(e) else e!r}") from None


def triplets_from_rows(rows, n_negatives: int, max_queries: int = 0) -> tuple[list[Triplet], int]:
    """Triplets from rows with query, positive and negative_1, negative_2, ... (or a `negatives` list); rows with
    fewer than n_negatives negatives or empty texts are skipped and counted. max_queries 0: every row."""
    triplets, skipped = [], 0
    for row in rows:
        negatives = row.get("negatives") or [row[f"negative_{i}"] for i in range(1, n_negatives + 1)
                                             if row.get(f"negative_{i}")]
        texts = [row.get("query"), row.get("positive"), *negatives[:n_negatives]]
        if len(negatives) < n_negatives or not all(isinstance(t, str) and t.strip() for t in texts):
            skipped += 1
            continue
        triplets.append(Triplet(texts[0], texts[1], texts[2:]))
        if len(triplets) % 100_000 == 0:
            logger.info(f"{len(triplets):,} triplets read")
        if len(triplets) == max_queries:
            break
    return triplets, skipped


@dataclass
class TripletArgs:
    out: str  # the JSONL file to write
    beir: str = ""  # BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv
    hub: str = ""  # msmarco, or a hub dataset with query, positive, negative_1.. columns (instead of beir)
    hub_config: str = ""  # the hub dataset's configuration (msmarco: triplet-50)
    max_queries: int = 0  # hub: rows kept (0: all)
    split: str = "train"  # the qrels split whose (query, positive) pairs become triplets
    n_negatives: int = 7  # hard negatives per triplet
    miner: str = "bm25"  # the ranking negatives come from (a model's: build_triplets(miner=embedder) in Python)
    skip_top: int = 0  # best-ranked non-positive documents skipped (likely unjudged positives)

    def __post_init__(self):
        require(bool(self.beir) != bool(self.hub), "beir",
                "or hub must be set, not both: a BEIR folder, or hub=msmarco")
        require(bool(self.out), "out", "must name the JSONL file to write")
        at_least(self, 1, "n_negatives")
        at_least(self, 0, "skip_top", "max_queries")
        require(self.miner == "bm25", "miner", f"must be 'bm25' on the command line, got {self.miner!r}")


def run(args: TripletArgs) -> list[Triplet]:
    return run_hub(args) if args.hub else run_beir(args)


def run_hub(args: TripletArgs) -> list[Triplet]:
    dataset, config = MSMARCO if args.hub == "msmarco" else (args.hub, args.hub_config)
    triplets, skipped = triplets_from_rows(hub_rows(dataset, args.hub_config or config), args.n_negatives,
                                           args.max_queries)
    if not triplets:
        raise UserError(f"{dataset} gave no triplet with {args.n_negatives} negatives ({skipped} rows skipped)")
    write_triplets(args.out, triplets)
    print(f"{dataset}: {len(triplets)} triplets with {args.n_negatives} negatives each ({skipped} rows skipped), "
          f"written to {args.out}")
    return triplets


def run_beir(args: TripletArgs) -> list[Triplet]:
    by_query = build_triplets(args.beir, args.split, args.n_negatives, args.miner, args.skip_top)
    triplets = [triplet for query_triplets in by_query.values() for triplet in query_triplets]
    write_triplets(args.out, triplets)
    print(f"{args.split}: {len(by_query)} queries, {len(triplets)} triplets with {args.n_negatives} {args.miner} "
          f"negatives each, written to {args.out}")
    return triplets


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(TripletArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        run(args)


if __name__ == "__main__":
    main()
