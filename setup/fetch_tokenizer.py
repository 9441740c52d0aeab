"""Fetch GPT-2's r50k_base BPE file without tiktoken's download host.

The file ships as whisper/assets/gpt2.tiktoken inside the `openai-whisper` package on PyPI, which publishes it as a
source archive only. We download that archive from PyPI's file host ourselves (pip would run the package's build code
to read its metadata, before any hash of ours is checked), check it against its published sha256 before opening it,
take that one file out, check it against tiktoken's published sha256 for r50k_base and write it atomically where
lingua/data/tokenizer.py looks first.

    python setup/fetch_tokenizer.py [--out DIR] [--archive FILE]
        # DIR: $LINGUA_TOKENIZER_DIR or ~/.cache/lingua by default; FILE: the archive fetched another way (a mirror)
"""

import argparse
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from lingua.data.tokenizer import R50K_FILENAME, R50K_SHA256, default_tokenizer_dir, sha256_of
from lingua.errors import UserError
from lingua.files.safe import atomic_write, fsync_dir

WHISPER = "openai-whisper==20250625"
ARCHIVE_URL = ("https://files.pythonhosted.org/packages/35/8e/d36f8880bcf18ec026a55807d02fe4c7357da9f25aebd92f85178000c0dc/"
               "openai_whisper-20250625.tar.gz")  # PyPI's file of that release (it has no wheel)
ARCHIVE_SHA256 = "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96"  # PyPI's published digest
MEMBER = "whisper/assets/gpt2.tiktoken"


def check_archive(archive: Path) -> None:
    """Refuses any file but the release's archive, before anything opens it."""
    try:
        data = archive.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {archive} ({e.strerror})") from None
    if sha256_of(data) != ARCHIVE_SHA256:
        raise UserError(f"{archive} does not match the sha256 PyPI publishes for {WHISPER}'s archive")


def read_member(archive: Path) -> bytes:
    """The BPE file from a source archive (read, never unpacked or run)."""
    with tarfile.open(archive) as tf:
        # sdists nest everything under NAME-VERSION/
        member = next((m for m in tf.getmembers() if m.name.endswith("/" + MEMBER)), None)
        if member is None:
            raise UserError(f"{archive.name} has no {MEMBER}")
        return tf.extractfile(member).read()


def download_whisper(tmp: Path) -> Path:
    """The release's archive in `tmp`, downloaded (nothing of it runs: pip is not involved)."""
    print(f"downloading {WHISPER}'s archive (nothing is built or installed)", flush=True)
    try:
        with urllib.request.urlopen(ARCHIVE_URL, timeout=120) as response:
            data = response.read()
    except OSError as e:  # no network, a refused host, an HTTP error, a timeout
        raise UserError(f"could not download {ARCHIVE_URL} ({e}); fetch that file another way and pass "
                        "--archive FILE") from None
    archive = tmp / ARCHIVE_URL.rsplit("/", 1)[1]
    archive.write_bytes(data)
    return archive


def fetch(out_dir: Path, archive: Path | None = None) -> Path:
    target = out_dir / R50K_FILENAME
    if target.exists() and sha256_of(target.read_bytes()) == R50K_SHA256:
        print(f"{target} already present and verified")
        return target
    with tempfile.TemporaryDirectory() as tmp:
        archive = archive or download_whisper(Path(tmp))
        check_archive(archive)
        data = read_member(archive)
    if sha256_of(data) != R50K_SHA256:
        raise UserError(f"{MEMBER} from {WHISPER} does not match r50k_base's sha256 {R50K_SHA256}")
    atomic_write(target, data)  # readers never see a half-written file
    fsync_dir(out_dir)
    print(f"wrote {target} (sha256 verified)")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for r50k_base.tiktoken")
    parser.add_argument("--archive", type=Path, default=None, help=f"{WHISPER}'s archive, if fetched another way")
    args = parser.parse_args(argv)
    try:
        fetch(args.out or default_tokenizer_dir(), args.archive)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
