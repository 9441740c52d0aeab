"""How fast the pre-training loader reads a corpus as published, per shard format, on one rank (docs/data.md):
    python -m tools.data_benchmark corpus=../shared/data/pretrain/enwiki_2015 [seconds=10] [shards=30,30000]

The corpus's documents (a folder of shards of any format) are written again as .jsonl, .jsonl.gz, .jsonl.zst and
.parquet sources of 5 shards each (the first held out for validation) in a temporary folder, then per format:
- throughput: the loader's tokens per second in the caller's thread (no read-ahead), packed rows of `seq_len`;
- resume: the time to the first batch from a state saved in the middle of a shard (the shard decompressed and parsed
  up to there), beside a fresh start, and the time to reach a shard's last document (the most a resume re-reads);
and for each count in `shards`, a source of that many small .jsonl.zst shards: the time to the first batch and the
growth of the resident memory, in a process of its own.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from lingua.args import command_line, load_config
from lingua.data.documents import SUFFIXES, documents
from lingua.data.loader import DataArgs, TrainLoader, source_files
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.errors import UserError, at_least
from lingua.files.untrusted import parse_json

SHARDS_PER_SOURCE = 5


@dataclass
class DataBenchmarkArgs:
    corpus: str = ""  # a folder of shards (.jsonl, .jsonl.gz, .jsonl.zst, .parquet) with a "text" field
    seconds: float = 10.0  # of reading per format
    shards: str = "30,30000"  # the shard counts whose start-up is measured (comma-separated; empty: none)
    seq_len: int = 512
    batch_size: int = 8
    shuffle_buffer: int = 64  # documents (training's default is 1,024): smaller than a shard here, so that a state
    # saved in the middle of a shard lies past whole blocks and its resume re-reads what a long shard's would
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)

    def __post_init__(self):
        at_least(self, 1, "seq_len", "batch_size", "shuffle_buffer")


def write_formats(texts: list[str], root: str) -> None:
    """The documents as one source per format, SHARDS_PER_SOURCE shards each."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    for suffix in SUFFIXES:
        folder = os.path.join(root, suffix.strip(".").replace(".", "_"))
        os.makedirs(folder)
        for k in range(SHARDS_PER_SOURCE):
            rows, path = texts[k::SHARDS_PER_SOURCE], os.path.join(folder, f"part-{k:05d}{suffix}")
            if suffix == ".parquet":
                pq.write_table(pa.table({"text": rows}), path)
                continue
            lines = "".join(json.dumps({"text": row}) + "\n" for row in rows).encode()
            compress = {".jsonl.gz": gzip.compress, ".jsonl.zst": zstandard.ZstdCompressor().compress}
            with open(path, "wb") as f:
                f.write(compress.get(suffix, bytes)(lines))


def loader_args(root: str, source: str, args: DataBenchmarkArgs) -> DataArgs:
    return DataArgs(root_dir=root, sources={source: 1.0}, seq_len=args.seq_len, batch_size=args.batch_size,
                    prefetch=0, shuffle_buffer=args.shuffle_buffer, tokenizer=args.tokenizer)


def first_batch_seconds(data: DataArgs, tokenizer, state=None) -> float:
    start = time.perf_counter()
    with TrainLoader(data, tokenizer, 0, 1, state=state) as loader:
        next(loader)
    return time.perf_counter() - start


def measure_format(root: str, source: str, args: DataBenchmarkArgs, tokenizer, n_docs: int) -> dict:
    data = loader_args(root, source, args)
    batches, start = 0, time.perf_counter()
    with TrainLoader(data, tokenizer, 0, 1) as loader:
        while time.perf_counter() - start < args.seconds:
            next(loader)
            batches += 1
        elapsed = time.perf_counter() - start
        half = n_docs // SHARDS_PER_SOURCE // 2  # documents: the middle of a shard
        while (position := loader.state_dict()["sources"][source])["block"] + position["document"] < half:
            next(loader)
        state = loader.state_dict()
    files = source_files(data, source)
    shard = os.path.join(files.folder, files.train[0])
    shard_docs = sum(1 for _ in documents(shard))
    start = time.perf_counter()
    next(documents(shard, start=shard_docs - 1))  # what the resume of a state at the shard's end re-reads
    return {"tokens_per_s": batches * args.batch_size * args.seq_len / elapsed,
            "shard_mb": os.path.getsize(shard) / 2**20, "shard_docs": shard_docs,
            "to_last_document_s": time.perf_counter() - start,
            "fresh_start_s": first_batch_seconds(data, tokenizer),
            "mid_shard_resume_s": first_batch_seconds(data, tokenizer, state)}


def write_many_shards(texts: list[str], folder: str, n: int) -> None:
    import zstandard

    compressor = zstandard.ZstdCompressor()
    os.makedirs(folder)
    for k in range(n):
        rows = [texts[(k * 10 + j) % len(texts)][:2000] for j in range(10)]
        with open(os.path.join(folder, f"{k // 1000:03d}_{k:06d}.jsonl.zst"), "wb") as f:
            f.write(compressor.compress("".join(json.dumps({"text": row}) + "\n" for row in rows).encode()))


def startup_in_child(root: str, source: str, tokenizer_args: dict) -> None:
    """Prints the seconds to the first batch and the growth of the peak resident memory (MiB), as JSON."""
    tokenizer = build_tokenizer(TokenizerArgs(**tokenizer_args))
    before = _peak_rss_mib()
    seconds = first_batch_seconds(DataArgs(root_dir=root, sources={source: 1.0}, seq_len=512, batch_size=8,
                                           prefetch=0), tokenizer)
    print(json.dumps({"first_batch_s": seconds, "rss_growth_mib": _peak_rss_mib() - before}))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(DataBenchmarkArgs, sys.argv[1:] if argv is None else argv)
        if not os.path.isdir(args.corpus):
            raise UserError(f"corpus folder not found: '{args.corpus}'")
        texts = [t for path in sorted(os.listdir(args.corpus)) if path.endswith(SUFFIXES)
                 for t in documents(os.path.join(args.corpus, path)) if isinstance(t, str)]
        tokenizer = build_tokenizer(args.tokenizer)
        print(f"{len(texts):,} documents, {sum(map(len, texts)) / 2**20:,.1f} MiB of text; seq_len {args.seq_len}, "
              f"batch {args.batch_size}, one rank, read in the caller's thread")
        with tempfile.TemporaryDirectory() as root:
            write_formats(texts, root)
            print("| format | shard: MiB, documents | tokens/s | first batch: fresh, resumed mid-shard (s) | "
                  "to a shard's last document (s) |\n|---|---|---|---|---|")
            for suffix in SUFFIXES:
                source = suffix.strip(".").replace(".", "_")
                m = measure_format(root, source, args, tokenizer, len(texts))
                print(f"| {suffix} | {m['shard_mb']:,.1f}, {m['shard_docs']:,} | {m['tokens_per_s']:,.0f} | "
                      f"{m['fresh_start_s']:.3f}, {m['mid_shard_resume_s']:.3f} | {m['to_last_document_s']:.3f} |",
                      flush=True)
            counts = [int(n) for n in args.shards.split(",") if n.strip()]
            if counts:
                print("\n| shards | listing and first batch (s) | peak resident memory growth (MiB) |\n|---|---|---|")
            for n in counts:
                write_many_shards(texts, os.path.join(root, f"many_{n}"), n)
                code = ("from tools.data_benchmark import startup_in_child; "
                        f"startup_in_child({root!r}, 'many_{n}', {dataclasses.asdict(args.tokenizer)!r})")
                child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                m = parse_json(child.stdout.splitlines()[-1], dict)
                print(f"| {n:,} | {m['first_batch_s']:.2f} | {m['rss_growth_mib']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
