"""How fast setup/prepare_data.py's `local` command prepares a published-style corpus, by format and worker count.

Generates (once, seeded) a corpus of web-like documents in two formats: .jsonl.zst shards with DCLM's metadata
fields, and .parquet shards with FineWeb's columns; then runs `prepare_data.py local` on each format with every
--workers count asked for, one fresh process at a time, the formats and counts taking turns in --rounds rounds (so
that a shared machine's drift hits all alike), and prints a markdown table of the medians (docs/data.md). Text MB
are the UTF-8 bytes of the documents' texts; seconds are the whole command's, start-up and the durable write
included; CPU seconds are its processes' user + system time (the cores used = CPU s / s).

    python scripts/prepare_data_speed.py --corpus /tmp/speed_corpus --megabytes 400 --workers 1 2
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FORMATS = ("jsonl.zst", "parquet")
MEAN_DOC_CHARS = 3000  # a DCLM or FineWeb document averages a few thousand characters


def vocabulary(rng: np.random.Generator, size: int = 20_000) -> np.ndarray:
    """Random words, a few with accents (the writer keeps non-ASCII text as UTF-8, ensure_ascii=False)."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxzéü"))
    weights = np.r_[np.ones(26), 0.05, 0.05]
    lengths = rng.integers(2, 11, size)
    return np.array(["".join(rng.choice(letters, n, p=weights / weights.sum())) for n in lengths], dtype=object)


def texts(rng: np.random.Generator, words: np.ndarray, total_chars: int):
    """Documents of Zipf-distributed words, log-normal lengths, until total_chars are made."""
    zipf = 1 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    made = 0
    while made < total_chars:
        n_words = max(5, int(rng.lognormal(np.log(MEAN_DOC_CHARS / 6), 0.8)))
        text = " ".join(words[rng.choice(len(words), n_words, p=zipf)])
        made += len(text.encode())
        yield text


def generate(corpus: Path, megabytes: int, shards: int, seed: int = 0) -> None:
    """CORPUS/jsonl.zst/ and CORPUS/parquet/, `shards` files each holding megabytes/2 MB of text, and
    CORPUS/corpus.json: the documents and text bytes of each format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    facts = {}
    for fmt in FORMATS:
        (corpus / fmt).mkdir(parents=True)
        docs = text_bytes = 0
        per_shard = megabytes * 10**6 // 2 // shards
        for shard in range(shards):
            batch = list(texts(rng, words, per_shard))
            ids = [f"{fmt}-{shard}-{i}" for i in range(len(batch))]
            urls = [f"https://example.org/{shard}/{i}.html" for i in range(len(batch))]
            path = corpus / fmt / f"shard_{shard:05d}.{fmt}"
            if fmt == "parquet":  # FineWeb's columns, in its row groups of about 1000 documents
                table = pa.table({"text": batch, "id": ids, "url": urls, "language_score": rng.random(len(batch))})
                pq.write_table(table, path, row_group_size=1000)
            else:  # DCLM's fields
                lines = "".join(json.dumps({"text": t, "url": u, "id": i, "fasttext_score": 0.5}, ensure_ascii=False)
                                + "\n" for t, u, i in zip(batch, urls, ids))
                path.write_bytes(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
            docs += len(batch)
            text_bytes += sum(len(t.encode()) for t in batch)
        facts[fmt] = {"documents": docs, "text_bytes": text_bytes,
                      "file_bytes": sum(p.stat().st_size for p in (corpus / fmt).iterdir())}
    (corpus / "corpus.json").write_text(json.dumps(facts, indent=1) + "\n")


def measure(corpus: Path, fmt: str, workers: int, scratch: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) of `prepare_data.py local` on one format's shards, in a fresh process."""
    cmd = [sys.executable, str(REPO / "setup" / "prepare_data.py"), "local", "--root", str(scratch),
           "--source", f"{fmt}_{workers}", "--workers", str(workers), str(corpus / fmt)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # its workers included: it waits for them
    shutil.rmtree(scratch / f"{fmt}_{workers}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="generated here unless it holds corpus.json")
    parser.add_argument("--megabytes", type=int, default=400, help="text in the corpus, both formats together")
    parser.add_argument("--shards", type=int, default=8, help="files per format")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (args.corpus / "corpus.json").is_file():
        generate(args.corpus, args.megabytes, args.shards)
    facts = json.loads((args.corpus / "corpus.json").read_text())
    runs = {(fmt, workers): [] for fmt in FORMATS for workers in args.workers}
    with tempfile.TemporaryDirectory(dir=args.corpus) as scratch:
        for _ in range(args.rounds):
            for fmt, workers in runs:
                runs[fmt, workers].append(measure(args.corpus, fmt, workers, Path(scratch)))
    print(f"{len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()[0]:.1f} at the end; corpus "
          f"{args.corpus}; medians of {args.rounds} rounds")
    print("| format | shards | documents | text MB | MB on disk | --workers | seconds | CPU s | documents/s "
          "| text MB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (fmt, workers), measured in runs.items():
        f, shards = facts[fmt], len(list((args.corpus / fmt).iterdir()))
        seconds, cpu = (statistics.median(m[i] for m in measured) for i in (0, 1))
        print(f"| .{fmt} | {shards} | {f['documents']:,} | {f['text_bytes'] / 1e6:.0f} | {f['file_bytes'] / 1e6:.0f} | "
              f"{workers} | {seconds:.1f} | {cpu:.1f} | {f['documents'] / seconds:,.0f} | "
              f"{f['text_bytes'] / 1e6 / seconds:.0f} |")


if __name__ == "__main__":
    main()
