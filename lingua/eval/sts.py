"""Semantic textual similarity (STS): the Spearman and Pearson correlations, in percent, between the cosine
similarity of two sentences' embeddings (see `Embedder` in lingua/eval/retrieval.py) and a gold score.

Every loader returns the scored pairs of one dataset as a list of (sentence1, sentence2, score). Formats read:
- SemEval STS 2012-2016 releases: `STS.input.<name>.txt` (STS 2016: `STS2016.input.<name>.txt`), one pair per line,
  tab-separated, the sentences first (STS 2016 adds two source columns), and `STS.gs.<name>.txt`, one gold score per
  line; STS 2015-2016 leave the line of an unscored pair empty, and such pairs are dropped. A gold file without an
  input partner (`STS.gs.ALL.txt`, STS 2013's SMT, whose sentences are not public) is skipped;
- STS Benchmark: `sts-{train,dev,test}.csv`, tab-separated without quoting, the score in column 5 and the sentences
  in columns 6 and 7 (some lines carry two more source columns);
- SICK: `SICK_{train,trial,test_annotated}.txt`, tab-separated with a header naming `sentence_A`, `sentence_B` and
  `relatedness_score`;
- JSONL: one object per line with `sentence1`, `sentence2` and a numeric `score`.
Sentences are stripped of surrounding spaces (some STS 2016 sentences end with one); blank lines of the CSV, SICK and
JSONL files are ignored.

`find_sts_sets(folder)` finds all of them under a folder and names them "STS12/MSRpar", "STSBenchmark/test",
"SICK/test", or by their path for a JSONL file ("mydata/dev" for mydata/dev.jsonl).
"""

import logging
import math
import re
from pathlib import Path

import torch
from scipy import stats

from lingua.errors import UserError
from lingua.eval.retrieval import Embedder, encode_texts, numbered_lines
from lingua.files.untrusted import Malformed, parse_json, parse_json_line

logger = logging.getLogger(__name__)

Pair = tuple[str, str, float]

SEMEVAL_INPUT = re.compile(r"^(STS\d*)\.input\.(.+)\.txt$")
SEMEVAL_GOLD = re.compile(r"^(STS\d*)\.gs\.(.+)\.txt$")
SEMEVAL_YEAR = re.compile(r"^sts[-_]?(?:20)?(1[2-6])(?:\D|$)", re.IGNORECASE)  # STS12, STS12-en-test, STS2016
STS_BENCHMARK = re.compile(r"^sts-(train|dev|test)\.csv$")
SICK = re.compile(r"^SICK_(train|trial|test)(?:_annotated)?\.txt$")


# ------------------------------------------------------------------------------------------------------ loaders


def read_semeval_sts(input_path: str | Path, gold_path: str | Path) -> list[Pair]:
    """The scored pairs of a SemEval STS input file and its gold file (pairs with an empty gold line dropped)."""
    sentences = [_split_columns(input_path, n, line, 2)[:2] for n, line in numbered_lines(input_path)]
    golds = [(line_no, line.strip()) for line_no, line in numbered_lines(gold_path)]
    if len(golds) != len(sentences):
        raise UserError(f"{gold_path} has {len(golds)} lines but {input_path} has {len(sentences)}: "
                        "they must have one line per pair")
    return [(a, b, _parse_score(gold_path, line_no, gold))
            for (a, b), (line_no, gold) in zip(sentences, golds) if gold]


def read_sts_benchmark(path: str | Path) -> list[Pair]:
    """The pairs of an STS Benchmark CSV file (genre, file, year, id, score, sentence1, sentence2[, sources])."""
    pairs = []
    for line_no, line in numbered_lines(path):
        if not line.strip():
            continue
        fields = _split_columns(path, line_no, line, 7)
        pairs.append((fields[5], fields[6], _parse_score(path, line_no, fields[4])))
    return pairs


def read_sick(path: str | Path) -> list[Pair]:
    """The pairs of a SICK file, by the columns its header names."""
    lines = numbered_lines(path)
    header = next(lines, (1, ""))[1].rstrip("\n").split("\t")
    wanted = ("sentence_A", "sentence_B", "relatedness_score")
    missing = [name for name in wanted if name not in header]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} in its header (is it a SICK file?)")
    a, b, score = (header.index(name) for name in wanted)
    pairs = []
    for line_no, line in lines:
        if not line.strip():
            continue
        fields = _split_columns(path, line_no, line, len(header))
        pairs.append((fields[a], fields[b], _parse_score(path, line_no, fields[score])))
    return pairs


def read_sts_jsonl(path: str | Path) -> list[Pair]:
    """The pairs of a JSONL file of {"sentence1", "sentence2", "score"} objects (blank lines ignored)."""
    pairs = []
    for line_no, line in numbered_lines(path):
        if line.strip():
            pairs.append(_jsonl_pair(path, line_no, line))
    return pairs


def _jsonl_pair(path: str | Path, line_no: int, line: str) -> Pair:
    record = parse_json_line(path, line_no, line)
    a, b, score = record.get("sentence1"), record.get("sentence2"), record.get("score")
    if not isinstance(a, str) or not isinstance(b, str):
        raise UserError(f"{path}:{line_no}: 'sentence1' and 'sentence2' must be strings")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise UserError(f"{path}:{line_no}: 'score' must be a finite number, got {score!r}")
    return a.strip(), b.strip(), float(score)


def _split_columns(path: str | Path, line_no: int, line: str, minimum: int) -> list[str]:
    # tab-separated with no quote handling (csv.QUOTE_NONE): STS sentences may begin with a lone '"'
    fields = [field.strip() for field in line.rstrip("\n").split("\t")]
    if len(fields) < minimum:
        raise UserError(f"{path}:{line_no}: expected at least {minimum} tab-separated columns, got {len(fields)}")
    return fields


def _parse_score(path: str | Path, line_no: int, value: str) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise UserError(f"{path}:{line_no}: the score must be a finite number, got {value.strip()!r}")
    return score


# ------------------------------------------------------------------------------------------------------ discovery


def find_sts_sets(folder: str | Path) -> dict[str, list[Pair]]:
    """{name: pairs} of every STS dataset under `folder` (searched recursively), sorted by name. A JSONL file counts
    when its first line has the three keys; a SemEval file without its partner is skipped (logged)."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"STS folder not found: {root}")
    found: dict[str, tuple[Path, list[Pair]]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        dataset = _recognise(root, path)
        if dataset is None:
            continue
        name, pairs = dataset
        if name in found:
            raise UserError(f"two STS datasets would be named {name!r}: {found[name][0]} and {path}")
        found[name] = (path, pairs)
    if not found:
        raise UserError(f"no STS dataset under {root} (SemEval STS.input/STS.gs files, STS Benchmark sts-*.csv, "
                        "SICK_*.txt or JSONL of sentence1/sentence2/score)")
    return {name: found[name][1] for name in sorted(found)}


def _recognise(root: Path, path: Path) -> tuple[str, list[Pair]] | None:
    """(name, pairs) when `path` is an STS dataset (a SemEval input file stands for its pair of files), else None."""
    if match := SEMEVAL_INPUT.match(path.name):
        gold = path.with_name(f"{match.group(1)}.gs.{match.group(2)}.txt")
        if not gold.is_file():
            logger.warning(f"{path}: no gold score file {gold.name} beside it, skipped")
            return None
        return f"{_semeval_year(root, path)}/{match.group(2)}", read_semeval_sts(path, gold)
    if match := SEMEVAL_GOLD.match(path.name):
        if not path.with_name(f"{match.group(1)}.input.{match.group(2)}.txt").is_file():
            logger.info(f"{path}: no input file beside it, skipped")
        return None
    if match := STS_BENCHMARK.match(path.name):
        return f"STSBenchmark/{match.group(1)}", read_sts_benchmark(path)
    if match := SICK.match(path.name):
        return f"SICK/{match.group(1)}", read_sick(path)
    if path.suffix == ".jsonl" and _looks_like_sts_jsonl(path):
        return path.relative_to(root).with_suffix("").as_posix(), read_sts_jsonl(path)
    return None


def _semeval_year(root: Path, path: Path) -> str:
    """"STS12" ... "STS16" from the nearest folder named so (STS12, STS12-en-test) or else the file's prefix
    (STS2016); failing both, the name of the file's folder."""
    relative = path.parent.relative_to(root)
    for folder in (relative, *relative.parents):  # nearest first, up to `root` itself
        if match := SEMEVAL_YEAR.match((root / folder).resolve().name):
            return f"STS{match.group(1)}"
    if match := SEMEVAL_YEAR.match(path.name):
        return f"STS{match.group(1)}"
    return path.parent.name


def _looks_like_sts_jsonl(path: Path) -> bool:
    """Whether the first line of a .jsonl file is an object with sentence1, sentence2 and score (a folder may hold
    other JSONL files, e.g. a BEIR corpus)."""
    first = next((line for _, line in numbered_lines(path)), "")
    try:
        record = parse_json(first, dict)
    except Malformed:
        return False
    return isinstance(record, dict) and {"sentence1", "sentence2", "score"} <= record.keys()


# ------------------------------------------------------------------------------------------------------ evaluation


def evaluate_sts(embedder: Embedder, pairs: list[Pair], batch_size: int = 32) -> dict:
    """Spearman and Pearson correlations (x100) between the cosine similarity of each pair's embeddings and its gold
    score; each distinct sentence is encoded once."""
    if len(pairs) < 2:
        raise UserError(f"STS evaluation needs at least 2 scored pairs, got {len(pairs)}")
    sentences = list(dict.fromkeys(s for a, b, _ in pairs for s in (a, b)))
    index = {sentence: i for i, sentence in enumerate(sentences)}
    vectors = encode_texts(embedder, sentences, batch_size)
    first = vectors[torch.tensor([index[a] for a, _, _ in pairs])]
    second = vectors[torch.tensor([index[b] for _, b, _ in pairs])]
    cosine = (first * second).sum(dim=1).double().numpy()
    gold = [score for _, _, score in pairs]
    return {"spearman": 100 * float(stats.spearmanr(cosine, gold).statistic),
            "pearson": 100 * float(stats.pearsonr(cosine, gold).statistic), "n_pairs": len(pairs)}
