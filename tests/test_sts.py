"""STS loaders (SemEval 2012-2016, STS Benchmark, SICK, JSONL), dataset discovery and the correlations."""

import json
import math
from pathlib import Path

import pytest
import torch
from scipy import stats
from test_retrieval import DATA, BagOfWords

from lingua.errors import UserError
from lingua.eval.sts import evaluate_sts, find_sts_sets, read_semeval_sts, read_sick, read_sts_benchmark, read_sts_jsonl


def write(path: Path, text: str, newline: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def write_sts_tree(root: Path) -> Path:
    """One small dataset in each format, plus files that are not datasets."""
    write(root / "STS12" / "STS.input.MSRpar.txt", 'A cat sat.\tA cat was sitting.\n"Quoted start\tNo quote\n')
    write(root / "STS12" / "STS.gs.MSRpar.txt", "4.4\n0.8\n")
    write(root / "STS12" / "STS.gs.ALL.txt", "4.4\n0.8\n")  # a gold file without input: skipped
    write(root / "STS16" / "STS2016.input.headlines.txt",
          "One\tTwo\tsource a\tsource b\nThree\tFour\tsource a\tsource b\nFive \tSix\tsource a\tsource b\n")
    write(root / "STS16" / "STS2016.gs.headlines.txt", "4\n\n1\n")  # the second pair is unscored
    write(root / "STSBenchmark" / "sts-test.csv",
          "main-captions\tMSRvid\t2012test\t0024\t2.500\tA girl is styling her hair.\tA girl is brushing her hair.\n"
          'main-forums\tanswer-answer\t2016\t0008\t3\t"Lone quote.\tOther.\tsource 1\tsource 2\n')
    write(root / "sick" / "SICK_test_annotated.txt",
          "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
          "6\tNo boy is playing\tKids are playing\t3.3\tNEUTRAL\n", newline="\r\n")
    write(root / "mine" / "dev.jsonl", json.dumps({"sentence1": "a", "sentence2": "b", "score": 1}) + "\n")
    write(root / "beir" / "corpus.jsonl", json.dumps({"_id": "d1", "text": "not an STS file"}) + "\n")
    return root


def test_each_format_loads(tmp_path):
    root = write_sts_tree(tmp_path)
    assert read_semeval_sts(root / "STS12" / "STS.input.MSRpar.txt", root / "STS12" / "STS.gs.MSRpar.txt") == [
        ("A cat sat.", "A cat was sitting.", 4.4), ('"Quoted start', "No quote", 0.8)]
    assert read_semeval_sts(root / "STS16" / "STS2016.input.headlines.txt",
                            root / "STS16" / "STS2016.gs.headlines.txt") == [("One", "Two", 4.0), ("Five", "Six", 1.0)]
    assert read_sts_benchmark(root / "STSBenchmark" / "sts-test.csv") == [
        ("A girl is styling her hair.", "A girl is brushing her hair.", 2.5), ('"Lone quote.', "Other.", 3.0)]
    assert read_sick(root / "sick" / "SICK_test_annotated.txt") == [("No boy is playing", "Kids are playing", 3.3)]
    assert read_sts_jsonl(root / "mine" / "dev.jsonl") == [("a", "b", 1.0)]


def test_find_sts_sets_names_every_dataset(tmp_path):
    root = write_sts_tree(tmp_path)
    # SentEval's layout: the year from an enclosing folder; or from the file's STS2016 prefix
    write(root / "STS13-en-test" / "test-gs" / "STS.input.FNWN.txt", "a\tb\n")
    write(root / "STS13-en-test" / "test-gs" / "STS.gs.FNWN.txt", "2\n")
    write(root / "other" / "STS2016.input.plagiarism.txt", "a\tb\tx\ty\n")
    write(root / "other" / "STS2016.gs.plagiarism.txt", "5\n")
    sets = find_sts_sets(root)
    assert {name: len(pairs) for name, pairs in sets.items()} == {
        "SICK/test": 1, "STS12/MSRpar": 2, "STS13/FNWN": 1, "STS16/headlines": 2, "STS16/plagiarism": 1,
        "STSBenchmark/test": 2, "mine/dev": 1}


@pytest.mark.parametrize("file, content, message", [
    ("STS12/STS.gs.MSRpar.txt", "4.4\n", r"STS\.gs\.MSRpar\.txt has 1 lines but .*STS\.input\.MSRpar\.txt has 2"),
    ("STS12/STS.gs.MSRpar.txt", "4.4\nhigh\n", r"STS\.gs\.MSRpar\.txt:2: the score must be a finite number"),
    ("STS12/STS.input.MSRpar.txt", "a\tb\nno tab\n", r"STS\.input\.MSRpar\.txt:2: expected at least 2 tab-sep"),
    ("STSBenchmark/sts-test.csv", "a\tb\tc\td\tnan\tx\ty\n", r"sts-test\.csv:1: the score must be a finite number"),
    ("sick/SICK_test_annotated.txt", "pair_ID\tsentence_A\tsentence_B\n", r"no column 'relatedness_score'"),
    ("mine/dev.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a"}\n',
     r"dev\.jsonl:2: 'sentence1' and 'sentence2' must be strings"),
    ("mine/dev.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a", "sentence2": "b", '
     '"score": "4"}\n', r"dev\.jsonl:2: 'score' must be a finite number"),
])
def test_a_malformed_file_names_its_line(tmp_path, file, content, message):
    root = write_sts_tree(tmp_path)
    write(root / file, content)
    with pytest.raises(UserError, match=message):
        find_sts_sets(root)


def test_find_sts_sets_on_a_folder_without_datasets(tmp_path):
    with pytest.raises(UserError, match="STS folder not found"):
        find_sts_sets(tmp_path / "missing")
    write(tmp_path / "readme.txt", "nothing here\n")
    with pytest.raises(UserError, match="no STS dataset under"):
        find_sts_sets(tmp_path)


class AngleEmbedder:
    """A fake embedder: the sentence "30" is the unit vector at 30 degrees, so a pair's cosine is known."""

    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        angles = torch.tensor([math.radians(float(t)) for t in texts])
        return torch.stack([angles.cos(), angles.sin()], dim=1)


def test_spearman_and_pearson_against_scipy():
    # cosines 0.985, 0.866, 0.5, 0: ranks 4 3 2 1; gold ranks 4 3 1 2 -> rho = 1 - 6 * 2 / (4 * 15) = 0.8
    pairs = [("0", "10", 4.0), ("0", "30", 3.0), ("0", "60", 1.0), ("0", "90", 2.0)]
    scores = evaluate_sts(AngleEmbedder(), pairs)
    cosines = [math.cos(math.radians(a)) for a in (10, 30, 60, 90)]
    gold = [4.0, 3.0, 1.0, 2.0]
    assert scores["spearman"] == pytest.approx(80.0)
    assert scores["spearman"] == pytest.approx(100 * stats.spearmanr(cosines, gold).statistic)
    assert scores["pearson"] == pytest.approx(100 * stats.pearsonr(cosines, gold).statistic)
    assert scores["n_pairs"] == 4


def test_each_sentence_is_encoded_once():
    embedder = BagOfWords()
    evaluate_sts(embedder, [("a cat", "a dog", 1.0), ("a cat", "the cat sat", 2.0), ("a dog", "the cat", 0.5)])
    assert embedder.calls == [4]  # a cat, a dog, the cat sat, the cat


def test_real_sts_sets_load():
    folder = DATA / "retrieval"
    if not (folder / "sts").is_dir() or not (folder / "sick").is_dir():
        pytest.skip(f"no real STS data under {folder}")
    sets = find_sts_sets(folder)
    per_year = {year: sum(len(p) for name, p in sets.items() if name.startswith(year + "/"))
                for year in ("STS12", "STS13", "STS14", "STS15", "STS16")}
    # SentEval's counts (STS13 without its SMT pairs, whose sentences are not public)
    assert per_year == {"STS12": 3108, "STS13": 1500, "STS14": 3750, "STS15": 3000, "STS16": 1186}
    assert len(sets) == 5 + 3 + 6 + 5 + 5 + 3 + 3
    assert {name: len(sets[name]) for name in ("STSBenchmark/train", "STSBenchmark/dev", "STSBenchmark/test",
                                               "SICK/train", "SICK/trial", "SICK/test")} == {
        "STSBenchmark/train": 5749, "STSBenchmark/dev": 1500, "STSBenchmark/test": 1379,
        "SICK/train": 4500, "SICK/trial": 500, "SICK/test": 4927}
    assert all(0 <= score <= 5 and a and b for pairs in sets.values() for a, b, score in pairs)
    scores = evaluate_sts(BagOfWords(), sets["STSBenchmark/test"])
    assert 30 < scores["spearman"] < 80  # word overlap alone correlates, far from perfectly
