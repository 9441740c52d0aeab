import io
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
import requests
import tiktoken
from conftest import load_setup_script

from lingua.args import UserError
from lingua.tokenizer import (
    R50K_FILENAME,
    TokenizerArgs,
    build_tokenizer,
    default_tokenizer_dir,
)

TEXT = "Hello world! Ünïcödé, emoji 🙂 and tabs\tand\nnewlines."


@pytest.fixture
def r50k_file() -> Path:
    path = default_tokenizer_dir() / R50K_FILENAME
    if not path.exists():
        pytest.skip(f"{path} not fetched (run python setup/fetch_tokenizer.py)")
    return path


@pytest.fixture
def no_network(monkeypatch):
    """Fail if tiktoken's downloading route is taken."""
    def refuse(name):
        raise requests.ConnectionError(f"network used for {name}")
    monkeypatch.setattr(tiktoken, "get_encoding", refuse)


def test_bytes_tokenizer():
    tok = build_tokenizer(TokenizerArgs(name="bytes"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.vocab_size) == (256, 257, 258, 259, 260)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 256
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id, tok.mask_id]) == TEXT
    assert tok.decode(tok.encode("<|endoftext|>")) == "<|endoftext|>"


def test_gpt2_tokenizer(r50k_file, no_network):
    tok = build_tokenizer(TokenizerArgs(name="gpt2", path=str(r50k_file)))
    specials = [tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id]
    assert specials == [50257, 50258, 50259, 50260] and tok.vocab_size == 50261
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids, unchanged
    ids = tok.encode(TEXT)
    assert max(ids) < 50257
    assert tok.decode([tok.bos_id] + ids + specials) == TEXT


def test_gpt2_endoftext_is_ordinary_text(r50k_file, no_network):
    tok = build_tokenizer(TokenizerArgs(path=str(r50k_file)))
    text = "end <|endoftext|> start"
    ids = tok.encode(text)
    assert 50256 not in ids and tok.decode(ids) == text


def test_default_location_from_env_is_used_before_network(r50k_file, no_network, tmp_path, monkeypatch):
    shutil.copy(r50k_file, tmp_path / R50K_FILENAME)
    monkeypatch.setenv("LINGUA_TOKENIZER_DIR", str(tmp_path))
    assert build_tokenizer(TokenizerArgs()).vocab_size == 50261


def test_sha256_mismatch_is_a_user_error(tmp_path, no_network, monkeypatch):
    bad = tmp_path / R50K_FILENAME
    bad.write_text("SGVsbG8= 0\n")
    with pytest.raises(UserError, match="sha256 mismatch.*fetch_tokenizer"):
        build_tokenizer(TokenizerArgs(path=str(bad)))
    monkeypatch.setenv("LINGUA_TOKENIZER_DIR", str(tmp_path))  # the default location is checked too
    with pytest.raises(UserError, match="sha256 mismatch"):
        build_tokenizer(TokenizerArgs())


def test_missing_file_is_a_user_error(tmp_path, no_network, monkeypatch):
    monkeypatch.setenv("LINGUA_TOKENIZER_DIR", str(tmp_path))  # nothing there, and tiktoken cannot download
    with pytest.raises(UserError, match="neither at .*absent.tiktoken nor at .*fetch_tokenizer"):
        build_tokenizer(TokenizerArgs(path=str(tmp_path / "absent.tiktoken")))
    with pytest.raises(UserError, match="not at .*fetch_tokenizer"):
        build_tokenizer(TokenizerArgs())


def test_a_stored_path_absent_here_finds_the_file_by_its_checksum(r50k_file, no_network, tmp_path, monkeypatch):
    """A run's config holds another machine's tokenizer.path: the same file in this machine's default location is
    used; a file of another checksum there is refused."""
    elsewhere = str(tmp_path / "colleague" / R50K_FILENAME)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv("LINGUA_TOKENIZER_DIR", str(here))
    (here / R50K_FILENAME).write_text("SGVsbG8= 0\n")
    with pytest.raises(UserError, match=f"{here / R50K_FILENAME} is not r50k_base \\(sha256 mismatch"):
        build_tokenizer(TokenizerArgs(path=elsewhere))
    shutil.copy(r50k_file, here / R50K_FILENAME)
    tok = build_tokenizer(TokenizerArgs(path=elsewhere))
    assert tok.vocab_size == 50261 and tok.encode("Hello world") == [15496, 995]


def test_unknown_name():
    with pytest.raises(UserError, match="'name' must be 'gpt2' or 'bytes'"):
        TokenizerArgs(name="sentencepiece")


MEMBER = b"fake bpe file\n"


def make_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("openai_whisper-1/whisper/assets/gpt2.tiktoken")
        info.size = len(MEMBER)
        tf.addfile(info, io.BytesIO(MEMBER))
    return path


def test_fetch_reads_sdist_and_wheel(tmp_path):
    fetch = load_setup_script("fetch_tokenizer")
    assert fetch.read_member(make_sdist(tmp_path / "w.tar.gz")) == MEMBER
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as zf:
        zf.writestr("whisper/assets/gpt2.tiktoken", MEMBER)
    assert fetch.read_member(tmp_path / "w.whl") == MEMBER


def test_fetch_rejects_wrong_hash(tmp_path, monkeypatch):
    fetch = load_setup_script("fetch_tokenizer")
    monkeypatch.setattr(fetch, "download_whisper", lambda tmp: make_sdist(tmp / "w.tar.gz"))
    with pytest.raises(UserError, match="does not match"):
        fetch.fetch(tmp_path / "out")
    assert not (tmp_path / "out" / R50K_FILENAME).exists()


def test_fetch_skips_verified_file(r50k_file, tmp_path, monkeypatch):
    fetch = load_setup_script("fetch_tokenizer")
    shutil.copy(r50k_file, tmp_path / R50K_FILENAME)
    monkeypatch.setattr(fetch, "download_whisper", lambda tmp: pytest.fail("downloaded again"))
    assert fetch.fetch(tmp_path) == tmp_path / R50K_FILENAME
