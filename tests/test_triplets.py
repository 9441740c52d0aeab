"""BM25 against hand-computed scores, hard-negative mining into triplets, the command line and the reader."""

import json
import math
import sys
import types
from dataclasses import asdict

import numpy as np
import pytest
from test_retrieval import DATA, BagOfWords, write_beir

from lingua.errors import UserError
from lingua.eval.triplets import (
    BM25,
    MSMARCO,
    Triplet,
    build_triplets,
    main,
    read_triplets,
    top_indices,
    triplets_from_rows,
    write_triplets,
)


def test_bm25_against_hand_computed_scores():
    bm25 = BM25(["the cat sat", "the dog", "cat cat dog bird"])
    # N = 3, avgdl = 3, k1 = 1.5, b = 0.75; idf(cat) = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln 1.6 = 0.4700
    # doc 0: tf 1, |d| 3: 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 3/3)) = 1      -> 0.4700
    # doc 2: tf 2, |d| 4: 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 4/3)) = 1.2903 -> 0.6065
    # "bird": idf = ln(1 + 2.5 / 1.5) = ln(8/3); doc 2: 1 * 2.5 / (1 + 1.875) = 0.8696 -> 0.8529
    scores = bm25.scores(["cat", "Cat, bird!", "cat cat", "unknown words"])
    np.testing.assert_allclose(scores[0], [0.4700036, 0, 0.6064563], rtol=1e-6)
    np.testing.assert_allclose(scores[1], [0.4700036, 0, 0.6064563 + 2.5 / 2.875 * math.log(8 / 3)], rtol=1e-6)
    np.testing.assert_allclose(scores[2], 2 * scores[0])  # a repeated query token counts twice
    np.testing.assert_array_equal(scores[3], [0, 0, 0])


def test_top_indices_breaks_ties_by_index():
    scores = np.array([0.0, 2.0, 1.0, 2.0, 0.0, 1.0])
    assert top_indices(scores, 4).tolist() == [1, 3, 2, 5]
    assert top_indices(scores, 10).tolist() == [1, 3, 2, 5, 0, 4]


# q1's positives are d1 and d2; d5 ("red") and d6 ("pie") share one word with it at equal length, so they tie and
# come in corpus order, then the documents sharing nothing, in corpus order (d3 first). The document "q1" is q1
# itself and never a negative. q2 judged d4 not relevant (score 0): it may be a negative.
CORPUS = {"d1": "red apple", "d2": "apple pie recipe", "d3": "blue ocean", "d4": "sky", "d5": "red car",
          "d6": "pie chart", "d7": "blue sky", "d8": "green grass", "q1": "red apple pie"}
QUERIES = {"q1": "red apple pie", "q2": "blue sky ocean"}
QRELS = {"train": ["q1\td1\t1", "q1\td2\t1", "q2\td3\t1", "q2\td4\t0"], "test": ["q2\td7\t1"]}


@pytest.fixture
def beir(tmp_path):
    return write_beir(tmp_path / "beir", CORPUS, QUERIES, QRELS)


def test_bm25_triplets(beir):
    by_query = build_triplets(beir, n_negatives=3)
    assert list(by_query) == ["q1", "q2"]
    q1 = by_query["q1"]
    assert [t.positive for t in q1] == ["red apple", "apple pie recipe"]
    assert all(t.query == "red apple pie" and t.negatives == ["red car", "pie chart", "blue ocean"] for t in q1)
    (q2,) = by_query["q2"]
    assert q2.positive == "blue ocean" and len(q2.negatives) == 3 and "blue ocean" not in q2.negatives
    assert q2.negatives[0] == "blue sky"  # shares two words with the query
    assert build_triplets(beir, n_negatives=3) == by_query  # deterministic


def test_skip_top_drops_the_best_ranked_negatives(beir):
    deeper = build_triplets(beir, n_negatives=4)
    skipped = build_triplets(beir, n_negatives=3, skip_top=1)
    for query_id in QUERIES:
        assert skipped[query_id][0].negatives == deeper[query_id][0].negatives[1:]


def test_mining_with_an_embedder(beir):
    (q2,) = build_triplets(beir, n_negatives=2, miner=BagOfWords())["q2"]
    # cosines with "blue sky ocean": "blue sky" 0.82, "sky" 0.58, then "red car" etc. at 0
    assert q2.negatives == ["blue sky", "sky"]
    q1 = build_triplets(beir, n_negatives=2, miner=BagOfWords())["q1"]
    assert all(set(t.negatives) == {"red car", "pie chart"} for t in q1)  # never "red apple pie", its own id


def test_too_small_a_corpus_is_a_user_error(beir):
    with pytest.raises(UserError, match="only 6 negatives after skip_top=0, need n_negatives=7"):
        build_triplets(beir, n_negatives=7)
    with pytest.raises(UserError, match="unknown miner 'dense'"):
        build_triplets(beir, miner="dense")


def test_command_line_writes_the_triplets(beir, tmp_path, capsys):
    out = tmp_path / "out" / "triplets.jsonl"
    main([f"beir={beir}", f"out={out}", "n_negatives=3"])
    assert f"train: 2 queries, 3 triplets with 3 bm25 negatives each, written to {out}" in capsys.readouterr().out
    expected = [t for triplets in build_triplets(beir, n_negatives=3).values() for t in triplets]
    assert read_triplets(out) == expected
    first = out.read_bytes()
    main([f"beir={beir}", f"out={out}", "n_negatives=3"])
    assert out.read_bytes() == first


def test_command_line_help_and_errors(beir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "n_negatives: int = 7" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([f"beir={beir}", f"out={tmp_path / 'x.jsonl'}", "miner=dense"])
    assert exit_info.value.code == 2 and "config key 'miner'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([f"out={tmp_path / 'x.jsonl'}"])
    assert "config key 'beir' or hub must be set" in capsys.readouterr().err


@pytest.mark.parametrize("record, message", [
    ('{"query": "q", "positive": "p", "negatives": "n"}', r":2: 'negatives' must be a list of strings"),
    ('{"query": "q", "positive": "p", "negatives": ["n", 3]}', r":2: 'negatives' must be a list of strings"),
    ('{"query": "", "positive": "p", "negatives": []}', r":2: 'query' must be a non-empty string"),
    ('{"query": "q", "negatives": []}', r":2: 'positive' must be a non-empty string"),
    ('{"query": "q", "positive": "p"', r":2: not valid JSON"),
    ('["q", "p", []]', r":2: expected a JSON object"),
])
def test_read_triplets_rejects_a_bad_line(tmp_path, record, message):
    path = tmp_path / "triplets.jsonl"
    path.write_text(json.dumps(asdict(Triplet("q", "p", ["n"]))) + "\n" + record + "\n")
    with pytest.raises(UserError, match=r"triplets\.jsonl" + message):
        read_triplets(path)


def test_read_triplets_round_trip_and_empty_file(tmp_path):
    triplets = [Triplet("q é", "p", ["n1", "n2"]), Triplet("q2", "p2", [])]
    write_triplets(tmp_path / "t.jsonl", triplets)
    assert read_triplets(tmp_path / "t.jsonl") == triplets
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="holds no triplet"):
        read_triplets(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match="file not found"):
        read_triplets(tmp_path / "missing.jsonl")


def test_scifact_train_triplets():
    folder = DATA / "retrieval" / "scifact"
    if not folder.is_dir():
        pytest.skip(f"no real data at {folder}")
    by_query = build_triplets(folder, n_negatives=7)
    triplets = [t for query_triplets in by_query.values() for t in query_triplets]
    assert (len(by_query), len(triplets)) == (809, 919)
    assert all(len(t.negatives) == 7 and t.positive not in t.negatives for t in triplets)


def test_hub_rows_become_triplets_and_short_rows_are_skipped(tmp_path, monkeypatch, capsys):
    rows = [{"query": "q1", "positive": "p1", **{f"negative_{i}": f"n{i}" for i in range(1, 51)}},
            {"query": "q2", "positive": "p2", "negative_1": "only one"},
            {"query": "q3", "positive": "p3", "negatives": ["a", "b", "c"]}]
    triplets, skipped = triplets_from_rows(rows, n_negatives=3)
    assert [t.negatives for t in triplets] == [["n1", "n2", "n3"], ["a", "b", "c"]] and skipped == 1
    assert len(triplets_from_rows(rows, n_negatives=3, max_queries=1)[0]) == 1

    asked = {}

    def load_dataset(name, config, split, streaming):
        asked.update(name=name, config=config, split=split, streaming=streaming)
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    out = tmp_path / "msmarco.jsonl"
    main(["hub=msmarco", f"out={out}", "n_negatives=3"])
    assert asked == {"name": MSMARCO[0], "config": "triplet-50", "split": "train", "streaming": True}
    assert [t.query for t in read_triplets(out)] == ["q1", "q3"]
    assert "1 rows skipped" in capsys.readouterr().out


def test_an_unreachable_hub_is_one_line(tmp_path, monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'sentence-transformers/msmarco' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(SystemExit) as exit_info:
        main(["hub=msmarco", f"out={tmp_path / 'x.jsonl'}"])
    assert exit_info.value.code == 2 and "cannot load" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
