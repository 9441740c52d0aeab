"""Tokenizers with the fixed special ids an encoder needs.

name="gpt2": GPT-2's byte-level BPE (tiktoken's r50k_base, as RoBERTa uses), ids 0..50256 unchanged
(50256 is GPT-2's <|endoftext|>, which `encode` never produces), then four ids of our own:

    <s>=50257  </s>=50258  <pad>=50259  <mask>=50260   vocab_size=50261

name="bytes": one id per UTF-8 byte (0..255), for tiny tests:

    <s>=256  </s>=257  <pad>=258  <mask>=259   vocab_size=260

name="hf": any Hugging Face `tokenizers` tokenizer, `path` a tokenizer.json or a folder holding one (a model folder
from the hub, saved locally). Its vocabulary is kept; the four special tokens are those its tokenizer_config.json
names (bos or cls, eos or sep, pad, mask), else the usual spellings found in its vocabulary (`<s>`/`[CLS]`, ...), else
added at its end (`<s>`, `</s>`, `<pad>`, `<mask>`). A run records the sha256 of both files (`sha256`, set when the
run starts) and refuses files that no longer match it, as a checkpoint must be read with the tokenizer it was
trained with.

`encode(text)` adds no special tokens and treats every string, "<|endoftext|>" and "<mask>" included, as ordinary
text; `decode(ids)` drops the four special ids.

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
from dataclasses import dataclass, replace
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from lingua.errors import UserError, require
from lingua.files.safe import RefusedFile, regular_file
from lingua.files.untrusted import Malformed, parse_json, read_bytes

logger = logging.getLogger(__name__)

# tiktoken's published hash of r50k_base.tiktoken (tiktoken_ext/openai_public.py)
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
R50K_FILENAME = "r50k_base.tiktoken"
HF_HINT = "data.tokenizer.path must name a tokenizer.json or a folder holding one"
FETCH_HINT = "run `python setup/fetch_tokenizer.py` or set tokenizer.path to a r50k_base.tiktoken file"


@dataclass
class TokenizerArgs:
    name: str = "gpt2"  # "gpt2" | "bytes" | "hf"
    # gpt2: a local r50k_base.tiktoken (empty or absent: default location, then tiktoken); hf: a tokenizer.json or
    # a folder holding one (required)
    path: str = ""
    sha256: str = ""  # hf: of the tokenizer.json and tokenizer_config.json a run started with (set by lingua/train.py)

    def __post_init__(self):
        require(self.name in ("gpt2", "bytes", "hf"), "name", f"must be 'gpt2', 'bytes' or 'hf', got '{self.name}'")
        require(self.name != "hf" or self.path, "path", "must name a tokenizer.json (or its folder) with name=hf")


def default_tokenizer_dir() -> Path:
    return Path(os.environ.get("LINGUA_TOKENIZER_DIR") or "~/.cache/lingua").expanduser()


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<mask>")  # bos, eos, pad and mask, as Lingua's own tokenizers spell them


class _Tokenizer:
    """Base-vocabulary ids 0..n_base-1, then <s>, </s>, <pad>, <mask>."""

    special_tokens = SPECIAL_TOKENS

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


# The names a tokenizer_config.json gives each special token, and the spellings looked for in a vocabulary without
# one, in order of preference.
ROLES = {"bos": ("bos_token", "cls_token"), "eos": ("eos_token", "sep_token"), "pad": ("pad_token",),
         "mask": ("mask_token",)}
USUAL_SPELLINGS = {"bos": ("<s>", "[CLS]", "<bos>", "<cls>"), "eos": ("</s>", "[SEP]", "<eos>", "<sep>"),
                   "pad": ("<pad>", "[PAD]"), "mask": ("<mask>", "[MASK]")}


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the four special ids an encoder needs (see the module's docstring)."""

    def __init__(self, tokenizer, config: dict, origin: str, sha256: str):
        self.tokenizer, self.sha256 = tokenizer, sha256
        tokenizer.encode_special_tokens = True  # "<mask>" in a text is text, as in Lingua's other tokenizers
        tokenizer.no_truncation()  # a saved tokenizer may carry its own: lengths are the data's and the model's
        tokenizer.no_padding()
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        spelled = {role: _special_token(role, config, vocab, origin) for role in ROLES}
        missing = [token for role, token in spelled.items() if token not in vocab]
        if missing:
            from tokenizers import AddedToken

            tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])
        self.origin, self.added = origin, missing
        self.special_tokens = tuple(spelled.values())
        self.bos_id, self.eos_id, self.pad_id, self.mask_id = (tokenizer.token_to_id(t) for t in self.special_tokens)
        if len({self.pad_id, self.mask_id, self.bos_id}) < 3 or len({self.pad_id, self.mask_id, self.eos_id}) < 3:
            raise UserError(f"tokenizer {origin}: its pad and mask tokens must differ from each other and from its "
                            f"start and end tokens, got {dict(zip(ROLES, self.special_tokens))}")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        specials = {self.bos_id, self.eos_id, self.pad_id, self.mask_id}
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in specials], skip_special_tokens=False)


def _special_token(role: str, config: dict, vocab: dict, origin: str) -> str:
    """The spelling of one special token: named by tokenizer_config.json, else found in the vocabulary, else ours."""
    for key in ROLES[role]:
        named = config.get(key)
        named = named.get("content") if isinstance(named, dict) else named
        if named is None:
            continue
        if not isinstance(named, str) or named not in vocab:
            raise UserError(f"tokenizer {origin}: tokenizer_config.json's {key} {named!r} is not in its vocabulary")
        return named
    return next((token for token in USUAL_SPELLINGS[role] if token in vocab), dict(zip(ROLES, SPECIAL_TOKENS))[role])


def _hf_files(path: str) -> tuple[Path, Path | None]:
    """The tokenizer.json `path` names (itself, or the one in that folder) and the tokenizer_config.json beside it,
    if any."""
    given = Path(path).expanduser()
    file = given / "tokenizer.json" if given.is_dir() else given
    config = file.parent / "tokenizer_config.json"
    return file, config if config.exists() else None


def _hf(args: TokenizerArgs) -> HFTokenizer:
    from tokenizers import Tokenizer

    file, config_file = _hf_files(args.path)
    try:
        data = regular_file(str(file)).read_bytes()
    except RefusedFile as e:
        raise UserError(f"tokenizer file {e}: {HF_HINT}") from None
    except OSError as e:
        raise UserError(f"cannot read tokenizer file {e.filename} ({e.strerror}): {HF_HINT}") from None
    config_bytes = read_bytes(config_file, "tokenizer config") if config_file else b""
    try:
        config = parse_json(config_bytes, dict) if config_file else {}
    except Malformed as e:
        raise UserError(f"tokenizer config {config_file}: {e}") from None
    digest = sha256_of(data + b"\0" + config_bytes)  # the config decides the special tokens
    if args.sha256 and digest != args.sha256:
        raise UserError(f"tokenizer {file} (and its tokenizer_config.json) is not the one the run was trained with "
                        f"(sha256 {digest[:12]}..., recorded {args.sha256[:12]}...): point data.tokenizer.path at "
                        "that one")
    try:
        tokenizer = Tokenizer.from_str(data.decode())
    except Exception as e:  # tokenizers raises a bare Exception on a file it cannot parse
        raise UserError(f"tokenizer file {file} is not a tokenizers tokenizer.json ({e})") from None
    return HFTokenizer(tokenizer, config, str(file), digest)


def recorded(args: TokenizerArgs) -> TokenizerArgs:
    """The args with the tokenizer's absolute path and the sha256 of its files (name=hf), which the run's config
    records: a tokenizer that changes after the run started is refused when the run resumes or its checkpoints are
    read."""
    if args.name != "hf":
        return args
    tokenizer = _hf(args)
    if tokenizer.added:
        logger.info(f"tokenizer {tokenizer.origin} has no {', '.join(tokenizer.added)}: added at the end of its "
                    "vocabulary")
    return replace(args, path=str(Path(tokenizer.origin).absolute()), sha256=tokenizer.sha256)


def build_tokenizer(args: TokenizerArgs) -> BytesTokenizer | TiktokenTokenizer | HFTokenizer:
    if args.name == "bytes":
        return BytesTokenizer()
    if args.name == "hf":
        return _hf(args)
    return TiktokenTokenizer(_r50k(args.path))
