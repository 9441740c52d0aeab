"""data.tokenizer.name=hf: a Hugging Face tokenizer.json (a BPE and a BERT-style WordPiece trained here with
`tokenizers`), its special tokens, the hash a run records, training and exact resume with it, and its export."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import read_metrics, tiny_argv, write_corpus, write_published_corpus

from apps.bert.train import APP as BERT
from apps.crossbert.train import APP as CROSSBERT
from lingua.args import load_config
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.errors import UserError
from lingua.train import train

tokenizers = pytest.importorskip("tokenizers")


def corpus_texts(root: Path) -> list[str]:
    return [json.loads(line)["text"] for file in sorted((root / "tiny").glob("train.*.jsonl"))
            for line in file.read_text().splitlines()]


def trained_bpe(root: Path, corpus: Path) -> Path:
    """A byte-level BPE trained on the tiny corpus, saved as a bare tokenizer.json: no special token at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus_texts(corpus), trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


def trained_wordpiece(root: Path, corpus: Path, config: dict) -> Path:
    """A BERT-style folder: an uncased WordPiece with [CLS] [SEP] [PAD] [MASK] [UNK], a truncation of its own, and
    tokenizer_config.json."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(corpus_texts(corpus), trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tokenizer.enable_truncation(8)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


BERT_CONFIG = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]"}


def test_a_bare_bpe_gets_the_special_tokens_added_and_keeps_its_vocabulary(corpus, tmp_path):
    file = trained_bpe(tmp_path / "bpe", corpus)
    ours = build_tokenizer(TokenizerArgs(name="hf", path=str(file)))
    raw = tokenizers.Tokenizer.from_file(str(file))
    n = raw.get_vocab_size()
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.mask_id, ours.vocab_size) == (n, n + 1, n + 2, n + 3, n + 4)
    assert ours.special_tokens == ("<s>", "</s>", "<pad>", "<mask>")
    text = "the cat sat on the <mask> and <s>"
    assert ours.encode("the cat sat") == raw.encode("the cat sat").ids  # its own ids
    assert ours.mask_id not in ours.encode(text) and ours.decode(ours.encode(text)) == text  # specials are text
    assert ours.decode([ours.bos_id, *ours.encode("the dog"), ours.eos_id, ours.pad_id]) == "the dog"


def test_a_folder_names_its_special_tokens_and_its_truncation_is_ignored(corpus, tmp_path):
    folder = trained_wordpiece(tmp_path / "wp", corpus, BERT_CONFIG)
    ours = build_tokenizer(TokenizerArgs(name="hf", path=str(folder)))
    vocab = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    assert ours.special_tokens == ("[CLS]", "[SEP]", "[PAD]", "[MASK]") and ours.vocab_size == len(vocab)
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.mask_id) == tuple(vocab[t] for t in ours.special_tokens)
    assert len(ours.encode("the cat sat on the mat " * 5)) > 8  # the file's truncation is not ours
    # without tokenizer_config.json the usual spellings are found in the vocabulary
    (folder / "tokenizer_config.json").unlink()
    assert build_tokenizer(TokenizerArgs(name="hf", path=str(folder))).special_tokens == ours.special_tokens


@pytest.mark.parametrize("config, message", [
    ({**BERT_CONFIG, "mask_token": "<m>"}, r"tokenizer_config.json's mask_token '<m>' is not in its vocabulary"),
    ({**BERT_CONFIG, "mask_token": "[PAD]"}, r"its pad and mask tokens must differ"),
    ({"mask_token": {"content": 3}}, r"mask_token 3 is not in its vocabulary"),
    (["a list"], r"tokenizer config .*tokenizer_config.json: "),
])
def test_special_tokens_that_cannot_be_determined_are_one_line(corpus, tmp_path, config, message):
    folder = trained_wordpiece(tmp_path / "wp", corpus, config)
    with pytest.raises(UserError, match=message):
        build_tokenizer(TokenizerArgs(name="hf", path=str(folder)))


def test_bad_paths_and_files_are_one_line(tmp_path):
    with pytest.raises(UserError, match="'path' must name a tokenizer.json"):
        TokenizerArgs(name="hf")
    with pytest.raises(UserError, match=r"tokenizer file .*nowhere is missing: data.tokenizer.path must name"):
        build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path / "nowhere")))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="is not a tokenizers tokenizer.json"):
        build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path)))


def hf_argv(corpus: Path, dump: Path, tokenizer: Path, steps: int) -> list[str]:
    return [*tiny_argv(corpus, dump, steps), "data.tokenizer.name=hf", f"data.tokenizer.path={tokenizer}",
            "validation.every=0"]


@pytest.mark.parametrize("app", [BERT, CROSSBERT], ids=["bert", "crossbert"])
def test_a_run_trains_records_the_hash_and_resumes_exactly(corpus, tmp_path, app):
    """On a corpus as published: zstd JSONL shards and parquet shards, read in place, mixed by weight."""
    file = trained_bpe(tmp_path / "bpe", corpus)
    published = write_published_corpus(corpus, tmp_path / "published")

    def argv(dump: Path) -> list[str]:
        return [*(a for a in hf_argv(corpus, dump, file, 20) if not a.startswith("data.sources.")),
                f"data.root_dir={published}", "data.sources.dclm=0.6", "data.sources.fineweb=0.4"]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(app, load_config(app.args_cls, argv(straight)))
    shutil.copytree(straight, resumed)  # as if killed after its step-10 checkpoint
    shutil.rmtree(resumed / "checkpoints" / "0000000020")
    (resumed / "consolidated.pt").unlink()
    train(app, load_config(app.args_cls, argv(resumed)))
    reference, continued = read_metrics(straight), read_metrics(resumed)
    assert sorted(continued) == list(range(1, 21))
    assert all(continued[s]["loss"] == reference[s]["loss"] for s in range(11, 21))
    import yaml

    saved = yaml.safe_load((straight / "config.yaml").read_text())["data"]["tokenizer"]
    assert saved["sha256"] == build_tokenizer(TokenizerArgs(name="hf", path=str(file))).sha256
    assert saved["path"] == str(file)  # absolute

    # the file changed under the run: resuming it is refused, and so is reading its checkpoints
    other = trained_bpe(tmp_path / "other", write_corpus(tmp_path / "other_corpus", seed=1))
    shutil.copyfile(other, file)
    with pytest.raises(UserError, match=r"holds a model of another shape \(data.tokenizer.sha256 "):
        train(app, load_config(app.args_cls, [*argv(resumed), "steps=30"]))
    from lingua.app import load_model

    with pytest.raises(UserError, match=r"tokenizer .* \(and its tokenizer_config.json\) is not the one the run was"):
        load_model(str(straight), "cpu")


def test_the_export_tokenizes_as_the_run_did(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lingua.export.embedder import load_embedder
    from lingua.export.hf_folder import main as export_main

    folder = trained_wordpiece(tmp_path / "wp", corpus, BERT_CONFIG)
    dump = tmp_path / "run"
    train(BERT, load_config(BERT.args_cls, hf_argv(corpus, dump, folder, 2)))
    export_main([f"ckpt={dump}", f"out={tmp_path / 'hf'}"])
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    ours = load_embedder(str(dump), "cpu").tokenizer
    assert (loaded.cls_token or loaded.bos_token) == "[CLS]" and loaded.mask_token == "[MASK]"
    for text in ["The cat sat on the mat.", "a dog ran to the park [MASK] quickly", ""]:
        assert loaded(text, split_special_tokens=True)["input_ids"] == [ours.bos_id, *ours.encode(text), ours.eos_id]
    assert loaded("a b", "c")["input_ids"] == [ours.bos_id, *ours.encode("a b"), ours.eos_id, ours.eos_id,
                                               *ours.encode("c"), ours.eos_id]
