"""BEIR loading, retrieval metrics against hand-computed values, and dense retrieval through a fake embedder."""

import json
import logging
import re
import zlib
from pathlib import Path

import pytest
import torch

from lingua.errors import UserError
from lingua.eval import retrieval
from lingua.eval.retrieval import dense_search, evaluate_retrieval, load_beir, mrr_at_k, ndcg_at_k, recall_at_k

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # /work/shared/data beside the repository


class BagOfWords:
    """A fake embedder: word counts hashed (crc32, stable across runs) into 4096 buckets, L2-normalised, so the
    cosine of two texts is predictable (the test vocabularies have no collision)."""

    def __init__(self):
        self.calls: list[int] = []  # the number of texts of each encode call

    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        self.calls.append(len(texts))
        vectors = torch.zeros(len(texts), 4096)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                vectors[row, zlib.crc32(word.encode()) % 4096] += 1
        return torch.nn.functional.normalize(vectors, dim=1)


def write_beir(folder: Path, corpus: dict[str, str], queries: dict[str, str], qrels: dict[str, list[str]]) -> Path:
    """A BEIR folder: corpus {id: text} (no titles), queries {id: text}, qrels {split: ["qid\tdid\tscore", ...]}."""
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(
        json.dumps({"_id": doc_id, "title": "", "text": text}) + "\n" for doc_id, text in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(
        json.dumps({"_id": query_id, "text": text}) + "\n" for query_id, text in queries.items()))
    for split, lines in qrels.items():
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(lines) + "\n")
    return folder


# q1 finds its relevant document at rank 2 behind an exact copy of itself; q2 at rank 1; q3's own id is a document
# (an exact copy of it), which BEIR's convention leaves out, so its relevant document d5 comes first.
CORPUS = {"d1": "red apple", "d2": "green apple pie", "d3": "blue sky", "q3": "yellow banana",
          "d5": "yellow banana bread"}
QUERIES = {"q1": "red apple", "q2": "blue sky", "q3": "yellow banana", "q4": "red sky"}
QRELS = {"test": ["q1\td2\t1", "q2\td3\t2", "q3\td5\t1"]}


# ------------------------------------------------------------------------------------------------------ metrics

# graded relevance; q3's relevant document is not retrieved; q4 has no relevant document (left out of the means)
HAND_QRELS = {"q1": {"d1": 2, "d2": 1}, "q2": {"d3": 1}, "q3": {"d4": 1}, "q4": {"d5": 0}}
HAND_RANKED = {"q1": ["d2", "x", "d1"], "q2": ["y", "d3"], "q3": ["a", "b"], "q4": ["d5"]}


def test_ndcg_against_hand_computed_values():
    # q1: DCG = 1/log2(2) + 2/log2(4) = 2, ideal = 2/log2(2) + 1/log2(3) = 2.63093 -> 0.76019
    # q2: DCG = 1/log2(3) = 0.63093, ideal 1; q3: 0. Mean over q1-q3: 0.46371
    assert ndcg_at_k(HAND_RANKED, HAND_QRELS, 10) == pytest.approx(0.4637058, abs=1e-6)
    # at k=2, q1 keeps only d2: 1 / 2.63093 = 0.38009 (the ideal is cut at 2 too)
    assert ndcg_at_k(HAND_RANKED, HAND_QRELS, 2) == pytest.approx(0.3370078, abs=1e-6)


def test_recall_and_mrr_against_hand_computed_values():
    assert recall_at_k(HAND_RANKED, HAND_QRELS, 100) == pytest.approx(2 / 3)  # 2/2, 1/1, 0/1
    assert recall_at_k(HAND_RANKED, HAND_QRELS, 2) == pytest.approx(0.5)  # 1/2, 1/1, 0/1
    assert mrr_at_k(HAND_RANKED, HAND_QRELS, 10) == pytest.approx(0.5)  # 1/1, 1/2, 0
    assert mrr_at_k(HAND_RANKED, HAND_QRELS, 1) == pytest.approx(1 / 3)  # only q1 has its first hit at rank 1


def test_a_query_missing_from_the_ranking_scores_zero_and_no_judged_query_is_an_error():
    assert ndcg_at_k({}, {"q1": {"d1": 1}}, 10) == 0
    with pytest.raises(UserError, match="no query has a relevant document"):
        recall_at_k({"q1": ["d1"]}, {"q1": {"d1": 0}}, 10)


# ------------------------------------------------------------------------------------------------------ loading


def test_load_beir(tmp_path, caplog):
    folder = write_beir(tmp_path / "beir", {"d1": "one", "d2": "two"}, {"q1": "first", "q2": "second", "q3": "x"},
                        {"test": ["q1\td1\t1", "q1\td2\t0", "q2\td9\t1", "q7\td1\t1", "q2\td2\t2"],
                         "train": ["q3\td1\t1"]})
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "title": "Title", "text": "one"}\n'
                                         '{"_id": "d2", "text": "two"}\n')
    with caplog.at_level(logging.WARNING):
        corpus, queries, qrels = load_beir(folder)
    assert corpus == {"d1": "Title one", "d2": "two"}
    assert queries == {"q1": "first", "q2": "second"}  # q3 is judged in train only
    assert qrels == {"q1": {"d1": 1, "d2": 0}, "q2": {"d2": 2}}
    assert "skipped 2 judgements naming an unknown query or document" in caplog.text


@pytest.mark.parametrize("file, content, message", [
    ("corpus.jsonl", '{"_id": "d1", "text": "one"}\n{"_id": "d2", "text": \n', r"corpus\.jsonl:2: not valid JSON"),
    ("corpus.jsonl", '{"_id": "d1", "text": "one"}\n{"_id": "d1", "text": "x"}\n', r"corpus\.jsonl:2: duplicate"),
    ("queries.jsonl", '["q1", "first"]\n', r"queries\.jsonl:1: expected a JSON object"),
    ("queries.jsonl", '{"_id": "q1"}\n', r"queries\.jsonl:1: 'text'"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1 d1 1\n", r"test\.tsv:3: expected 'query-id"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\thigh\n", r"test\.tsv:2: the score must be an integer"),
])
def test_load_beir_rejects_a_malformed_line(tmp_path, file, content, message):
    folder = write_beir(tmp_path / "beir", {"d1": "one"}, {"q1": "first"}, {"test": ["q1\td1\t1"]})
    (folder / file).write_text(content)
    with pytest.raises(UserError, match=message):
        load_beir(folder)


def test_load_beir_names_a_missing_file(tmp_path):
    folder = write_beir(tmp_path / "beir", {"d1": "one"}, {"q1": "first"}, {"test": ["q1\td1\t1"]})
    with pytest.raises(UserError, match=r"file not found: .*qrels/dev\.tsv"):
        load_beir(folder, "dev")
    (folder / "queries.jsonl").unlink()
    with pytest.raises(UserError, match=r"file not found: .*queries\.jsonl"):
        load_beir(folder)


# ------------------------------------------------------------------------------------------------------ search


def test_evaluate_retrieval_with_a_predictable_embedder(tmp_path):
    folder = write_beir(tmp_path / "beir", CORPUS, QUERIES, QRELS)
    scores = evaluate_retrieval(BagOfWords(), folder)
    # nDCG: q1 1/log2(3), q2 1, q3 1; MRR: 1/2, 1, 1
    assert scores == pytest.approx({"ndcg@10": 87.697658, "recall@100": 100.0, "mrr@10": 250 / 3,
                                    "n_queries": 3, "n_docs": 5})
    # keeping the document with q3's id puts d5 second for q3 too
    scores = evaluate_retrieval(BagOfWords(), folder, exclude_self=False)
    assert scores["ndcg@10"] == pytest.approx(75.395317) and scores["mrr@10"] == pytest.approx(200 / 3)


class RandomEmbedder(BagOfWords):
    """A fake embedder without ties: a random unit vector per text, seeded by the text."""

    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        self.calls.append(len(texts))
        vectors = [torch.randn(16, generator=torch.Generator().manual_seed(zlib.crc32(t.encode()))) for t in texts]
        return torch.nn.functional.normalize(torch.stack(vectors), dim=1)


def test_chunked_search_equals_a_full_sort(monkeypatch, caplog):
    corpus = {f"d{i}": f"document {i}" for i in range(40)}
    queries = {f"q{i}": f"query {i}" for i in range(9)} | {"d3": "a query whose id is a document's"}
    monkeypatch.setattr(retrieval, "QUERY_BLOCK", 3)
    embedder = RandomEmbedder()
    with caplog.at_level(logging.INFO):
        ranked = dense_search(embedder, queries, corpus, top_k=7, batch_size=1)
    assert embedder.calls == [10] + [4] * 10  # the queries, then the corpus in tenths
    assert "40/40 documents encoded" in caplog.text
    scores = embedder.encode(list(queries.values())) @ embedder.encode(list(corpus.values())).T
    scores[list(queries).index("d3"), 3] = -float("inf")  # a query never retrieves the document of its own id
    expected = {q: [f"d{i}" for i in row.argsort(descending=True)[:7].tolist()] for q, row in zip(queries, scores)}
    assert ranked == expected


def test_top_k_beyond_the_corpus_returns_every_other_document():
    ranked = dense_search(BagOfWords(), {"q3": "yellow banana"}, CORPUS, top_k=100)
    assert ranked["q3"][0] == "d5" and sorted(ranked["q3"]) == ["d1", "d2", "d3", "d5"]


def test_evaluate_retrieval_needs_the_top_10(tmp_path):
    with pytest.raises(UserError, match="top_k must be >= 10"):
        evaluate_retrieval(BagOfWords(), tmp_path, top_k=5)


# ------------------------------------------------------------------------------------------------------ real data


def test_scifact_loads_and_bm25_matches_beir():
    folder = DATA / "retrieval" / "scifact"
    if not folder.is_dir():
        pytest.skip(f"no real data at {folder}")
    from lingua.eval.triplets import bm25_search

    corpus, queries, qrels = load_beir(folder, "test")
    assert (len(corpus), len(queries), sum(len(docs) for docs in qrels.values())) == (5183, 300, 339)
    ranked = bm25_search(queries, corpus, top_k=100)
    # the BEIR paper's BM25 (Elasticsearch) gets nDCG@10 0.665 on SciFact
    assert ndcg_at_k(ranked, qrels, 10) == pytest.approx(0.665, abs=0.01)
