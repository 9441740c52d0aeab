"""Dense retrieval evaluation on a BEIR-format folder, through any sentence embedder.

Embedder protocol (`Embedder`): `encode(texts, batch_size=32)` returns a float32 tensor [len(texts), D] on the CPU,
one L2-normalised row per text, in the order of `texts`; cosine similarity is then a dot product.

BEIR layout:
- `corpus.jsonl`: one object per line, `{"_id": ..., "title": ..., "text": ...}` (title optional); a document's
  text is `title + " " + text`, or `text` alone when the title is empty;
- `queries.jsonl`: `{"_id": ..., "text": ...}`;
- `qrels/<split>.tsv`: a header `query-id corpus-id score`, then one tab-separated judgement per line, the score an
  integer relevance grade (0: judged not relevant).

Protocol (BEIR's, as computed by pytrec_eval / trec_eval):
- every query with at least one relevant document (score > 0) in the split is searched over the whole corpus; a
  document whose id equals the query's id is never retrieved (`exclude_self`: some datasets hold the queries in the
  corpus);
- nDCG@k: gain = the graded score, discount log2(rank + 1), divided by the ideal DCG of the query's sorted scores;
  recall@k: the fraction of the query's relevant documents in its top k; MRR@k: 1 / rank of the first relevant one;
- each is a mean over the queries with a relevant document; `evaluate_retrieval` reports them in percent.
"""

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from lingua.errors import UserError
from lingua.files.untrusted import parse_json_line

logger = logging.getLogger(__name__)

QUERY_BLOCK = 256  # queries scored at once against a corpus chunk: bounds the score matrix to 256 x chunk floats
MAX_CORPUS_CHUNK = 50_000  # documents encoded and searched at once: bounds the memory on big corpora

Ranking = dict[str, list[str]]  # query id -> document ids, best first
Qrels = dict[str, dict[str, int]]  # query id -> {document id: relevance grade}


class Embedder(Protocol):
    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """[len(texts), D] float32 on the CPU, rows L2-normalised, in the order of `texts`."""


def encode_texts(embedder: Embedder, texts: list[str], batch_size: int) -> torch.Tensor:
    """The embedder's vectors for `texts`, checked to be one row per text."""
    vectors = embedder.encode(texts, batch_size=batch_size)
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise ValueError(f"the embedder returned shape {tuple(vectors.shape)} for {len(texts)} texts, "
                         f"expected [{len(texts)}, D]")
    return vectors.float()


# ------------------------------------------------------------------------------------------------------ BEIR files


def load_beir(folder: str | Path, split: str = "test") -> tuple[dict[str, str], dict[str, str], Qrels]:
    """(corpus {doc id: text}, queries {query id: text} of the queries judged in `split`, qrels) of a BEIR folder.
    Judgements naming an unknown query or document are skipped, with a warning."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"BEIR folder not found: {folder}")
    corpus = {doc_id: text for doc_id, text in _read_records(folder / "corpus.jsonl", title=True)}
    if not corpus:
        raise UserError(f"{folder / 'corpus.jsonl'} holds no document")
    all_queries = dict(_read_records(folder / "queries.jsonl", title=False))
    qrels_path = folder / "qrels" / f"{split}.tsv"
    qrels: Qrels = {}
    unknown = 0
    for query_id, doc_id, score in read_qrels(qrels_path):
        if query_id in all_queries and doc_id in corpus:
            qrels.setdefault(query_id, {})[doc_id] = score
        else:
            unknown += 1
    if unknown:
        logger.warning(f"{qrels_path}: skipped {unknown} judgements naming an unknown query or document")
    if not qrels:
        raise UserError(f"{qrels_path}: no judgement names a query of queries.jsonl and a document of corpus.jsonl")
    queries = {query_id: text for query_id, text in all_queries.items() if query_id in qrels}
    return corpus, queries, qrels


def read_qrels(path: Path) -> Iterator[tuple[str, str, int]]:
    """(query id, document id, score) per judgement of a BEIR qrels TSV file, after its header."""
    for line_no, line in numbered_lines(path):
        fields = line.rstrip("\n").split("\t")
        if line_no == 1 and fields[0] == "query-id":
            continue
        if len(fields) != 3 or not fields[0] or not fields[1]:
            raise UserError(f"{path}:{line_no}: expected 'query-id<TAB>corpus-id<TAB>score', got {line.strip()!r}")
        try:
            score = int(fields[2])
        except ValueError:
            raise UserError(f"{path}:{line_no}: the score must be an integer, got {fields[2]!r}") from None
        yield fields[0], fields[1], score


def _read_records(path: Path, title: bool) -> Iterator[tuple[str, str]]:
    """(id, text) per line of a BEIR corpus (title=True: the title is prepended) or queries file."""
    seen = set()
    for line_no, line in numbered_lines(path):
        if not line.strip():
            continue
        record = parse_json_line(path, line_no, line)
        record_id, text = record.get("_id"), record.get("text")
        if not isinstance(record_id, (str, int)) or isinstance(record_id, bool) or str(record_id) == "":
            raise UserError(f"{path}:{line_no}: '_id' must be a non-empty string, got {record_id!r}")
        record_id = str(record_id)
        heading = (record.get("title") or "") if title else ""
        if not isinstance(text, str) or not isinstance(heading, str):
            raise UserError(f"{path}:{line_no}: 'text' (and 'title' if present) must be strings")
        if record_id in seen:
            raise UserError(f"{path}:{line_no}: duplicate _id {record_id!r}")
        seen.add(record_id)
        yield record_id, f"{heading} {text}" if heading else text


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of a UTF-8 text file (a byte-order mark dropped, CRLF line ends read as LF),
    with one-line errors for a missing or unreadable file."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from enumerate(f, start=1)
    except FileNotFoundError:
        raise UserError(f"file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


# ------------------------------------------------------------------------------------------------------ search


def dense_search(embedder: Embedder, queries: dict[str, str], corpus: dict[str, str], top_k: int,
                 batch_size: int = 32, exclude_self: bool = True) -> Ranking:
    """The `top_k` documents of highest cosine similarity per query, best first. The corpus is encoded and searched
    chunk by chunk (about a tenth of it at a time, at most MAX_CORPUS_CHUNK documents), keeping a running top k, so
    memory stays bounded whatever the corpus size."""
    query_ids, doc_ids = list(queries), list(corpus)
    query_vectors = encode_texts(embedder, list(queries.values()), batch_size)
    doc_index = {doc_id: i for i, doc_id in enumerate(doc_ids)}
    # the corpus position of each query's own id, or -1: that document is never retrieved
    self_index = torch.tensor([doc_index.get(q, -1) if exclude_self else -1 for q in query_ids], dtype=torch.long)
    k = min(top_k, len(doc_ids))
    best_scores = torch.full((len(query_ids), k), -math.inf)
    best_index = torch.full((len(query_ids), k), -1, dtype=torch.long)
    texts = list(corpus.values())
    chunk = min(MAX_CORPUS_CHUNK, math.ceil(len(texts) / 10 / batch_size) * batch_size)
    start_time = time.perf_counter()
    for start in range(0, len(texts), chunk):
        doc_vectors = encode_texts(embedder, texts[start:start + chunk], batch_size)
        for q in range(0, len(query_ids), QUERY_BLOCK):
            rows = slice(q, q + QUERY_BLOCK)
            scores = query_vectors[rows] @ doc_vectors.T
            _hide_own_documents(scores, self_index[rows] - start)
            best_scores[rows], best_index[rows] = _merge_top_k(best_scores[rows], best_index[rows], scores, start)
        done = min(start + chunk, len(texts))
        if len(texts) > chunk and done * 10 // len(texts) > start * 10 // len(texts):
            logger.info(f"corpus: {done}/{len(texts)} documents encoded and searched "
                        f"({100 * done // len(texts)}%), {time.perf_counter() - start_time:.0f}s")
    return {query_id: [doc_ids[i] for i, s in zip(index.tolist(), scores.tolist()) if s > -math.inf]
            for query_id, index, scores in zip(query_ids, best_index, best_scores)}


def _hide_own_documents(scores: torch.Tensor, own_column: torch.Tensor) -> None:
    """Sets each row's score at `own_column` (its query's own document in this chunk, if there) to -inf."""
    rows = torch.nonzero((own_column >= 0) & (own_column < scores.shape[1])).flatten()
    scores[rows, own_column[rows]] = -math.inf


def _merge_top_k(best_scores: torch.Tensor, best_index: torch.Tensor, scores: torch.Tensor, offset: int):
    """The running top k updated with a chunk's scores (columns offset, offset + 1, ... of the corpus)."""
    k = best_scores.shape[1]
    chunk_scores, chunk_index = scores.topk(min(k, scores.shape[1]), dim=1)
    all_scores = torch.cat([best_scores, chunk_scores], dim=1)
    all_index = torch.cat([best_index, chunk_index + offset], dim=1)
    top_scores, position = all_scores.topk(k, dim=1)
    return top_scores, all_index.gather(1, position)


# ------------------------------------------------------------------------------------------------------ metrics


def ndcg_at_k(ranked: Ranking, qrels: Qrels, k: int) -> float:
    """Mean nDCG@k (in [0, 1]) over the queries with a relevant document; a query missing from `ranked` scores 0."""
    def ndcg(ranking: list[str], grades: dict[str, int]) -> float:
        dcg = sum(max(grades.get(doc_id, 0), 0) / math.log2(rank + 1) for rank, doc_id in enumerate(ranking[:k], 1))
        ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:k]
        return dcg / sum(g / math.log2(rank + 1) for rank, g in enumerate(ideal, 1))
    return _mean_over_judged_queries(ndcg, ranked, qrels)


def recall_at_k(ranked: Ranking, qrels: Qrels, k: int) -> float:
    """Mean fraction (in [0, 1]) of each query's relevant documents (score > 0) found in its top k."""
    def recall(ranking: list[str], grades: dict[str, int]) -> float:
        relevant = {doc_id for doc_id, g in grades.items() if g > 0}
        return len(relevant.intersection(ranking[:k])) / len(relevant)
    return _mean_over_judged_queries(recall, ranked, qrels)


def mrr_at_k(ranked: Ranking, qrels: Qrels, k: int) -> float:
    """Mean reciprocal rank (in [0, 1]) of the first relevant document within the top k (0 when none is)."""
    def reciprocal_rank(ranking: list[str], grades: dict[str, int]) -> float:
        return next((1 / rank for rank, doc_id in enumerate(ranking[:k], 1) if grades.get(doc_id, 0) > 0), 0.0)
    return _mean_over_judged_queries(reciprocal_rank, ranked, qrels)


def _mean_over_judged_queries(metric, ranked: Ranking, qrels: Qrels) -> float:
    values = [metric(ranked.get(query_id, []), grades) for query_id, grades in qrels.items()
              if any(g > 0 for g in grades.values())]
    if not values:
        raise UserError("no query has a relevant document (qrels score > 0): nothing to evaluate")
    return sum(values) / len(values)


def evaluate_retrieval(embedder: Embedder, folder: str | Path, split: str = "test", batch_size: int = 32,
                       top_k: int = 100, exclude_self: bool = True) -> dict:
    """nDCG@10, recall@top_k and MRR@10 in percent of dense retrieval with `embedder` on a BEIR folder's split,
    with the number of queries evaluated (those with a relevant document) and of documents."""
    if top_k < 10:
        raise UserError(f"top_k must be >= 10 (nDCG@10 and MRR@10 read the top 10), got {top_k}")
    corpus, queries, qrels = load_beir(folder, split)
    judged = {q: text for q, text in queries.items() if any(g > 0 for g in qrels[q].values())}
    if not judged:
        raise UserError(f"{folder}: no query of the {split} split has a relevant document (qrels score > 0)")
    ranked = dense_search(embedder, judged, corpus, top_k, batch_size, exclude_self)
    return {"ndcg@10": 100 * ndcg_at_k(ranked, qrels, 10), f"recall@{top_k}": 100 * recall_at_k(ranked, qrels, top_k),
            "mrr@10": 100 * mrr_at_k(ranked, qrels, 10), "n_queries": len(judged), "n_docs": len(corpus)}
