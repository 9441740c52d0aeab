"""Tokenizers with the fixed special ids an encoder needs.

name="gpt2": GPT-2's byte-level BPE (tiktoken's r50k_base, as RoBERTa uses), ids 0..50256 unchanged
(50256 is GPT-2's <|endoftext|>, which `encode` never produces), then four ids of our own:

    <s>=50257  </s>=50258  <pad>=50259  <mask>=50260   vocab_size=50261

name="bytes": one id per UTF-8 byte (0..255), for tiny tests:

    <s>=256  </s>=257  <pad>=258  <mask>=259   vocab_size=260

`encode(text)` adds no special tokens and treats every string, "<|endoftext|>" included, as ordinary text;
`decode(ids)` drops the four special ids.

The r50k_base file is found by its name and checksum, not by its path, so that a run's config (which may hold the
absolute path of another machine) opens anywhere the same file is. It is looked up in this order, so that nothing is
downloaded when a local copy exists:
1. `TokenizerArgs.path`, when set and the file exists;
2. `$LINGUA_TOKENIZER_DIR/r50k_base.tiktoken` (default dir ~/.cache/lingua), written by setup/fetch_tokenizer.py;
3. tiktoken's own `get_encoding("r50k_base")`, which downloads the file (and caches it) and checks its hash.
A local file must be a regular file (a FIFO would block) and match tiktoken's published sha256 for r50k_base: one
that does not is refused, never skipped.
"""

import base64
import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from lingua.errors import UserError, require
from lingua.files.safe import RefusedFile, regular_file

logger = logging.getLogger(__name__)

# tiktoken's published hash of r50k_base.tiktoken (tiktoken_ext/openai_public.py)
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
R50K_FILENAME = "r50k_base.tiktoken"
FETCH_HINT = "run `python setup/fetch_tokenizer.py` or set tokenizer.path to a r50k_base.tiktoken file"


@dataclass
class TokenizerArgs:
    name: str = "gpt2"  # "gpt2" | "bytes"
    path: str = ""  # local r50k_base.tiktoken file (gpt2 only); empty or absent: default location, then tiktoken

    def __post_init__(self):
        require(self.name in ("gpt2", "bytes"), "name", f"must be 'gpt2' or 'bytes', got '{self.name}'")


def default_tokenizer_dir() -> Path:
    return Path(os.environ.get("LINGUA_TOKENIZER_DIR") or "~/.cache/lingua").expanduser()


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Tokenizer:
    """Base-vocabulary ids 0..n_base-1, then <s>, </s>, <pad>, <mask>."""

    def __init__(self, n_base: int):
        self.bos_id, self.eos_id, self.pad_id, self.mask_id = range(n_base, n_base + 4)
        self.vocab_size = n_base + 4

    def _base_ids(self, ids) -> list[int]:
        return [int(i) for i in ids if i < self.bos_id]


class BytesTokenizer(_Tokenizer):
    def __init__(self):
        super().__init__(256)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids) -> str:
        return bytes(self._base_ids(ids)).decode("utf-8", errors="replace")


class TiktokenTokenizer(_Tokenizer):
    def __init__(self, encoding: tiktoken.Encoding):
        super().__init__(encoding.n_vocab)
        self.encoding = encoding

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.encoding.decode(self._base_ids(ids))


@functools.lru_cache(maxsize=4)
def _r50k_from_file(path: str) -> tiktoken.Encoding:
    try:
        data = regular_file(path).read_bytes()  # a FIFO would block the read for ever
    except RefusedFile as e:
        raise UserError(f"tokenizer file {e}; {FETCH_HINT}") from None
    except OSError as e:
        raise UserError(f"cannot read tokenizer file {path} ({e.strerror}); {FETCH_HINT}") from e
    if sha256_of(data) != R50K_SHA256:
        raise UserError(f"tokenizer file {path} is not r50k_base (sha256 mismatch); {FETCH_HINT}")
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    return tiktoken.Encoding("r50k_base", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def _r50k(path: str) -> tiktoken.Encoding:
    default = default_tokenizer_dir() / R50K_FILENAME
    if path and Path(path).exists():
        return _r50k_from_file(path)
    if path:  # e.g. another machine's location, stored in the config of a run copied here
        logger.warning(f"tokenizer.path {path} does not exist: looking for r50k_base (sha256 {R50K_SHA256[:12]}...) "
                       f"in {default}, then through tiktoken")
    if default.exists():
        return _r50k_from_file(str(default))
    try:
        return tiktoken.get_encoding("r50k_base")
    except (OSError, ValueError) as e:  # no network (requests errors are OSErrors) or a corrupt download
        where = f"neither at {path} nor at {default}" if path else f"not at {default}"
        raise UserError(f"r50k_base (sha256 {R50K_SHA256[:12]}...) is {where}, and tiktoken could not fetch it; "
                        f"{FETCH_HINT}") from e


def build_tokenizer(args: TokenizerArgs) -> BytesTokenizer | TiktokenTokenizer:
    if args.name == "bytes":
        return BytesTokenizer()
    return TiktokenTokenizer(_r50k(args.path))
