"""MTEB: the encoder wrapper through mteb's own evaluation on tiny tasks defined here (no download), the paper's
table, the command's help and its one-line error when the Hugging Face Hub is out of reach."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


class HashedBagOfWords:
    """A stand-in Embedder: each lower-cased word hashed to one of `dim` counts, normalised. Records what it reads."""

    name, dim = "hashed-bow", 256

    def __init__(self):
        self.texts: list[str] = []

    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        self.texts += texts
        counts = torch.zeros(len(texts), self.dim)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                counts[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1
        return F.normalize(counts, dim=-1)


def tiny_tasks():
    """An STS and a retrieval task held in memory, built the way mteb's mock tasks are: the gold similarity of the
    STS pairs rises with their word overlap and each query shares its words with its one relevant document, so a
    bag of words scores 100 on both when every embedding comes back in its text's place."""
    from datasets import Dataset, DatasetDict
    from mteb import TaskMetadata
    from mteb.abstasks import AbsTaskRetrieval, AbsTaskSTS
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

    common = dict(
        description="A tiny in-memory task for the tests.", reference="https://github.com/embeddings-benchmark/mteb",
        dataset={"path": "NA", "revision": "NA"}, category="t2t", eval_splits=["test"], eval_langs=["eng-Latn"],
        date=("2024-01-01", "2024-01-01"), dialect=["Written"], domains=[], task_subtypes=[], license="cc-by-4.0",
        annotations_creators="derived", modalities=["text"], sample_creation="found", bibtex_citation="")

    class TinySTS(AbsTaskSTS):
        metadata = TaskMetadata(type="STS", name="TinySTS", main_score="cosine_spearman", **common)
        min_score, max_score = 0, 5

        def load_data(self, num_proc=None, **kwargs):
            self.dataset = DatasetDict({"test": Dataset.from_dict({
                "sentence1": ["the cat sat on the mat", "a dog runs in the park", "birds sing in the morning",
                              "red stones lie by water"],
                "sentence2": ["the cat sat on the mat", "a dog runs in the garden", "birds fly over the river",
                              "she plays chess at night"],
                "score": [5.0, 4.0, 2.0, 0.0]})})
            self.data_loaded = True

    class TinyRetrieval(AbsTaskRetrieval):
        metadata = TaskMetadata(type="Retrieval", name="TinyRetrieval", main_score="ndcg_at_10", **common)

        def load_data(self, num_proc=None, **kwargs):
            split = RetrievalSplitData(
                queries=Dataset.from_list([{"id": "q1", "text": "where does the cat sleep"},
                                           {"id": "q2", "text": "rivers flow to the sea"},
                                           {"id": "q3", "text": "chess openings"}]),
                corpus=Dataset.from_list([{"id": "d1", "title": "Cats", "text": "the cat sleeps on a warm mat"},
                                          {"id": "d2", "title": "Chess", "text": "openings of a chess game"},
                                          {"id": "d3", "title": "Water", "text": "every river flows to the sea"}]),
                relevant_docs={"q1": {"d1": 1}, "q2": {"d3": 1}, "q3": {"d2": 1}},
                top_ranked=None)
            self.dataset = {"default": {"test": split}}
            self.data_loaded = True

    return [TinySTS(), TinyRetrieval()]


def test_tiny_tasks_score_through_mtebs_evaluation_and_resume(tmp_path):
    pytest.importorskip("mteb")
    import mteb

    from lingua.eval.mteb import MtebEncoder, run_mteb

    embedder = HashedBagOfWords()
    assert isinstance(MtebEncoder(embedder), mteb.EncoderProtocol)
    scores = run_mteb(embedder, tiny_tasks(), results_dir=tmp_path, batch_size=2)
    assert scores == {
        "TinySTS": {"type": "STS", "metric": "cosine_spearman", "score": pytest.approx(100)},
        "TinyRetrieval": {"type": "Retrieval", "metric": "ndcg_at_10", "score": pytest.approx(100)},
    }
    # no prompt: a query is read as written, a document as mteb joins it (title, then text)
    assert "where does the cat sleep" in embedder.texts and "Cats the cat sleeps on a warm mat" in embedder.texts
    results = tmp_path / "results" / "lingua__hashed-bow" / "no_revision_available"
    assert (results / "TinySTS.json").is_file() and (results / "TinyRetrieval.json").is_file()

    read = len(embedder.texts)
    assert run_mteb(embedder, tiny_tasks(), results_dir=tmp_path) == scores  # mteb's files are reused
    assert len(embedder.texts) == read
    run_mteb(embedder, tiny_tasks()[:1], results_dir=tmp_path, overwrite=True)
    assert len(embedder.texts) == read + 8  # the 4 STS pairs again


def test_task_selection_keeps_the_benchmarks_subsets_and_names_mistakes():
    pytest.importorskip("mteb")
    from lingua.errors import UserError
    from lingua.eval.mteb import select_tasks

    assert len(select_tasks("MTEB(eng, v2)")) == 41
    sts17, scifact = select_tasks("MTEB(eng, v2)", ["STS17", "SciFact"])
    assert sts17.hf_subsets == ["en-en"] and scifact.metadata.name == "SciFact"  # SciFact is not in v2: taken whole
    with pytest.raises(UserError, match=r"benchmark 'MTEB\(eng, v3\)' not found. Did you mean: MTEB\(eng, v2\)"):
        select_tasks("MTEB(eng, v3)")
    with pytest.raises(UserError, match="task 'STS1' not found. Did you mean"):
        select_tasks("MTEB(eng, v2)", ["STS1"])


def test_summary_is_the_papers_table():
    pytest.importorskip("mteb")
    from lingua.eval.mteb import format_table, summarize

    scores = {name: {"type": task_type, "metric": "m", "score": score} for name, task_type, score in [
        ("A", "STS", 80.0), ("B", "Retrieval", 30.0), ("C", "STS", 60.0), ("D", "BitextMining", 50.0),
        ("E", "Classification", 70.0)]}
    summary = summarize(scores)
    # the paper's categories in its order, other types after them; Avg. = mean of the 4 type means, Overall = of all 5
    assert list(summary) == ["Classification", "Retrieval", "STS", "BitextMining", "Avg.", "Overall"]
    assert summary == {"Classification": 70.0, "Retrieval": 30.0, "STS": 70.0, "BitextMining": 50.0,
                       "Avg.": pytest.approx(55.0), "Overall": pytest.approx(58.0)}
    header, row = format_table(scores, summary, "tiny").splitlines()[-2:]
    assert header.split() == ["model", "Classification", "Clustering", "PairClassification", "Reranking",
                              "Retrieval", "STS", "Summarization", "BitextMining", "Avg.", "Overall"]
    assert row.split() == ["tiny", "70.00", "-", "-", "-", "30.00", "70.00", "-", "50.00", "55.00", "58.00"]


def test_unreachable_hub_is_a_one_line_error(tmp_path):
    """Offline, with an empty Hugging Face cache, the command stops at the first task's data with one line."""
    pytest.importorskip("mteb")
    run_command = ("import lingua.export.embedder, test_mteb\n"
                   "lingua.export.embedder.load_embedder = lambda path, **kwargs: test_mteb.HashedBagOfWords()\n"
                   "from tools.eval.mteb import main\n"
                   f"main(['ckpt={tmp_path}', 'tasks=STS12', 'out={tmp_path / 'out'}'])\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", run_command], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: cannot get the data of MTEB task STS12 from the Hugging Face Hub (Couldn't reach 'mteb/sts12-sts' on "
        "the Hub (OfflineModeIsEnabled)): MTEB needs network access, or the datasets already in the Hugging Face cache"]


def test_offline_tasks_stand_for_each_type_and_score_through_mtebs_evaluation(tmp_path):
    """The stand-ins built from local files (here a small copy of the shared data's layout, without SICK): one or
    two per type of the paper's table but Summarization, scored by mteb; `names` picks among them."""
    pytest.importorskip("mteb")
    from conftest import offline_data

    from lingua.eval.mteb import run_mteb, summarize
    from lingua.eval.mteb_offline import offline_tasks

    data = offline_data(tmp_path / "shared")
    tasks = offline_tasks(data)
    assert [(t.metadata.name, t.metadata.type) for t in tasks] == [
        ("SST2Offline", "Classification"), ("GlueSourceOffline", "Clustering"),
        ("MRPCOffline", "PairClassification"), ("SciFactOffline", "Retrieval"),
        ("SciFactRerankOffline", "Reranking"), ("STSBOffline", "STS")]
    scores = run_mteb(HashedBagOfWords(), tasks, results_dir=tmp_path / "results", batch_size=16)
    assert list(summarize(scores)) == ["Classification", "Clustering", "PairClassification", "Reranking",
                                       "Retrieval", "STS", "Avg.", "Overall"]
    # each query shares its words with its document (and two of the same words but another title): well above chance
    assert scores["SciFactOffline"]["score"] > 50 and scores["SciFactRerankOffline"]["score"] > 50
    assert [t.metadata.name for t in offline_tasks(data, ["STSBOffline"])] == ["STSBOffline"]


def test_offline_tasks_name_what_is_missing(tmp_path):
    pytest.importorskip("mteb")
    from lingua.errors import UserError
    from lingua.eval.mteb_offline import offline_tasks

    with pytest.raises(UserError, match="is not a folder"):
        offline_tasks(tmp_path / "nowhere")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(UserError, match="no task's files under"):
        offline_tasks(tmp_path / "empty")
    from conftest import offline_data

    with pytest.raises(UserError, match="offline MTEB task 'SICKROffline' is not among those built"):
        offline_tasks(offline_data(tmp_path / "shared"), ["SICKROffline"])
