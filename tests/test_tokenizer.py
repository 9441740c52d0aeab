import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest
import requests
import tiktoken
from conftest import load_setup_script, run_to_the_end, tiny_argv, write_corpus

from lingua.data.tokenizer import (
    FETCH_HINT,
    R50K_FILENAME,
    TokenizerArgs,
    build_tokenizer,
    default_tokenizer_dir,
)
from lingua.errors import UserError

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


def test_a_tokenizer_path_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """Training with data.tokenizer.path naming a FIFO: one line, at once (it used to wait for a writer for ever;
    here a hang fails the test at the timeout)."""
    os.mkfifo(tmp_path / "pipe")
    argv = [*tiny_argv(write_corpus(tmp_path / "data"), tmp_path / "run", steps=1), "data.tokenizer.name=gpt2",
            f"data.tokenizer.path={tmp_path / 'pipe'}"]
    done = run_to_the_end([sys.executable, "-m", "apps.bert.train", *argv], timeout=120)
    assert done.returncode == 2 and done.stderr == f"error: tokenizer file {tmp_path / 'pipe'} is not a regular " \
        f"file; {FETCH_HINT}\n", done.stderr[-2000:]


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
    with pytest.raises(UserError, match="'name' must be 'gpt2', 'bytes' or 'hf'"):
        TokenizerArgs(name="sentencepiece")


MEMBER = b"fake bpe file\n"


def make_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("openai_whisper-1/whisper/assets/gpt2.tiktoken")
        info.size = len(MEMBER)
        tf.addfile(info, io.BytesIO(MEMBER))
    return path


def test_fetch_reads_the_sdist(tmp_path):
    fetch = load_setup_script("fetch_tokenizer")
    assert fetch.read_member(make_sdist(tmp_path / "w.tar.gz")) == MEMBER


def test_fetch_rejects_wrong_hash(tmp_path, monkeypatch):
    fetch = load_setup_script("fetch_tokenizer")
    monkeypatch.setattr(fetch, "download_whisper", lambda tmp: make_sdist(tmp / "w.tar.gz"))
    monkeypatch.setattr(fetch, "check_archive", lambda archive: None)  # the member's own check
    with pytest.raises(UserError, match="does not match r50k_base's sha256"):
        fetch.fetch(tmp_path / "out")
    assert not (tmp_path / "out" / R50K_FILENAME).exists()


def test_fetch_skips_verified_file(r50k_file, tmp_path, monkeypatch):
    fetch = load_setup_script("fetch_tokenizer")
    shutil.copy(r50k_file, tmp_path / R50K_FILENAME)
    monkeypatch.setattr(fetch, "download_whisper", lambda tmp: pytest.fail("downloaded again"))
    assert fetch.fetch(tmp_path) == tmp_path / R50K_FILENAME


def test_fetch_runs_nothing_of_the_archive_and_refuses_another_before_opening_it(tmp_path, monkeypatch):
    """openai-whisper publishes a source archive only: `pip download` would run its build code (setup.py) before any
    hash were checked. The archive is downloaded as a file, and one of another sha256 is refused before it is opened."""
    fetch = load_setup_script("fetch_tokenizer")
    archive = tmp_path / "served.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        code = f"open({str(tmp_path / 'built')!r}, 'w').write('ran')\n".encode()
        info = tarfile.TarInfo("openai_whisper-20250625/setup.py")
        info.size = len(code)
        tf.addfile(info, io.BytesIO(code))
    served = []
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout: served.append(url) or open(archive, "rb"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"a process was started: {a}"))
    monkeypatch.setattr(fetch.tarfile, "open", lambda *a, **k: pytest.fail("an unchecked archive was opened"))
    with pytest.raises(UserError, match="openai_whisper-20250625.tar.gz does not match the sha256 PyPI publishes"):
        fetch.fetch(tmp_path / "out")
    assert served == [fetch.ARCHIVE_URL] and not (tmp_path / "built").exists()
    assert not (tmp_path / "out").exists()
