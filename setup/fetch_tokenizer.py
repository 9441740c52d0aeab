"""Fetch GPT-2's r50k_base BPE file without tiktoken's download host.

The file ships as whisper/assets/gpt2.tiktoken inside the `openai-whisper` package on PyPI. We ask pip for the
archive alone (no install, no dependencies), take that one file out, check it against tiktoken's published sha256
for r50k_base and write it atomically where lingua/tokenizer.py looks first.

    python setup/fetch_tokenizer.py [--out DIR]     # default DIR: $LINGUA_TOKENIZER_DIR or ~/.cache/lingua
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from lingua.args import UserError
from lingua.tokenizer import R50K_FILENAME, R50K_SHA256, default_tokenizer_dir, sha256_of

WHISPER = "openai-whisper==20250625"
MEMBER = "whisper/assets/gpt2.tiktoken"


def read_member(archive: Path) -> bytes:
    """The BPE file from an sdist (.tar.gz) or a wheel (.whl), whichever pip gave."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            return zf.read(MEMBER)
    with tarfile.open(archive) as tf:
        # sdists nest everything under NAME-VERSION/
        member = next((m for m in tf.getmembers() if m.name.endswith("/" + MEMBER)), None)
        if member is None:
            raise UserError(f"{archive.name} has no {MEMBER}")
        return tf.extractfile(member).read()


def download_whisper(tmp: Path) -> Path:
    print(f"downloading {WHISPER} (archive only, nothing installed)", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), WHISPER]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"pip download {WHISPER} failed: {last}")
    return next(tmp.iterdir())


def fetch(out_dir: Path) -> Path:
    target = out_dir / R50K_FILENAME
    if target.exists() and sha256_of(target.read_bytes()) == R50K_SHA256:
        print(f"{target} already present and verified")
        return target
    with tempfile.TemporaryDirectory() as tmp:
        data = read_member(download_whisper(Path(tmp)))
    if sha256_of(data) != R50K_SHA256:
        raise UserError(f"{MEMBER} from {WHISPER} does not match r50k_base's sha256 {R50K_SHA256}")
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f".{R50K_FILENAME}.{os.getpid()}.partial"
    partial.write_bytes(data)
    partial.replace(target)  # atomic: readers never see a half-written file
    print(f"wrote {target} (sha256 verified)")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for r50k_base.tiktoken")
    args = parser.parse_args(argv)
    try:
        fetch(args.out or default_tokenizer_dir())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
