"""Export to a HuggingFace folder (lingua/export/hf_folder.py): transformers' AutoModel gives our states and embeddings,
sentence-transformers our embeddings, the exported tokenizer our ids; the folder's code needs no Lingua."""

import ast
import errno
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_to_the_end, tiny_argv, write_corpus

from apps.bert.train import APP as BERT
from apps.crossbert.train import APP as CROSSBERT
from lingua.app import build_from_params, load_model
from lingua.args import load_config, to_dict
from lingua.checkpoint.store import save_consolidated
from lingua.data.tokenizer import R50K_FILENAME, default_tokenizer_dir
from lingua.errors import UserError
from lingua.eval.features import encode_example, pad_batch
from lingua.export.embedder import load_embedder
from lingua.export.hf_folder import MARKER, ExportArgs, beside, export, main
from lingua.files import written_folder
from lingua.train import train
from tests.test_contrastive import contrastive_argv, run_contrastive, write_triplets
from tools.eval import glue as glue_command

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat", "a", "héllo wörld, 日本語 🤗", "<s> </s> <pad> <mask> <|endoftext|> as text",
         "  spaces,\nnew lines\r\n\tand tabs  ", "the big red house by the river " * 4, ""]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A tiny CrossBERT pre-training run (no pooler: mean pooling; an output bias, which the export leaves out)
    and a contrastive run started from it (its attention pooler warm-started from the predictor), fine-tuned so
    that both the encoder and the pooler moved."""
    root = tmp_path_factory.mktemp("runs")
    pretrained = root / "crossbert"
    argv = tiny_argv(write_corpus(root / "data"), pretrained, 4) + ["validation.every=0",
                                                                    "model.encoder.output_bias=true"]
    train(CROSSBERT, load_config(CROSSBERT.args_cls, argv))
    contrastive = root / "contrastive"
    run_contrastive(contrastive_argv(write_triplets(root / "t.jsonl", 32), contrastive, pretrained, 3,
                                     "model.frozen=false"))
    return {"mean": pretrained, "attention": contrastive}


def export_to(out: Path, ckpt: Path, **options) -> Path:
    return export(ExportArgs(ckpt=str(ckpt), out=str(out), **options))


def our_batch(embedder, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rows and pad mask that Lingua's feature extraction feeds the encoder."""
    seqs = [encode_example(embedder.tokenizer, (text,), embedder.max_len) for text in texts]
    return pad_batch(seqs, embedder.tokenizer.pad_id, torch.device("cpu"))


def assert_transformers_matches(folder: Path, embedder) -> None:
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model, loading = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert type(config).__name__ == "LinguaConfig" and not any(loading.values()), loading
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    # special tokens written in a text are text, as in Lingua (an export with a masked-LM head parses them by default)
    batch = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt", split_special_tokens=True)
    tokens, pad_mask = our_batch(embedder, TEXTS)
    assert torch.equal(batch["input_ids"], tokens) and torch.equal(batch["attention_mask"].bool(), pad_mask)
    with torch.no_grad():
        output = model.eval()(**batch)
        hidden = embedder.model.encode(tokens, pad_mask)
    torch.testing.assert_close(output.last_hidden_state, hidden, atol=1e-5, rtol=0)
    torch.testing.assert_close(output.pooler_output, embedder.encode(TEXTS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, options", [("attention", {}), ("mean", {}), ("attention", {"pooling": "mean"}),
                                           ("attention", {"max_len": 12})],
                         ids=["attention-pooler", "mean", "attention-run-pooled-by-mean", "max_len-12"])
def test_transformers_gives_our_states_and_embeddings(runs, tmp_path, kind, options):
    folder = export_to(tmp_path / "hf", runs[kind], **options)
    embedder = load_embedder(str(runs[kind]), "cpu", **options)
    config = json.loads((folder / "config.json").read_text())
    pooled_by_attention = kind == "attention" and options.get("pooling") != "mean"
    assert config["pooling"] == ("attention" if pooled_by_attention else "mean")
    assert_transformers_matches(folder, embedder)


LOAD_TOKENIZER = """
import json, sys
import transformers
folder, texts = sys.argv[1], json.loads(sys.argv[2])
loaded = {"fast": transformers.PreTrainedTokenizerFast.from_pretrained(folder),
          "auto": transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False)}
if len(sys.argv) > 3:
    loaded["auto, no flag"] = transformers.AutoTokenizer.from_pretrained(folder)
print("tokens:", json.dumps({name: {"ids": [tokenizer(text, truncation=True, split_special_tokens=True)["input_ids"]
                                 for text in texts],
                         "pair": tokenizer("a b", "c")["input_ids"],
                         "special": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token,
                                     tokenizer.mask_token]}
                  for name, tokenizer in loaded.items()}))
print("code from the folder:", sorted(name for name in sys.modules if name.startswith("transformers_modules")))
"""


def test_the_exported_tokenizer_loads_with_no_code_from_the_folder(runs, tmp_path):
    """tokenizer.json and a tokenizer_config.json naming PreTrainedTokenizerFast: loaded without trust_remote_code,
    stdin closed (a [y/N] question would read an empty answer), it gives our ids. transformers 5's AutoTokenizer
    reads config.json first, whose AutoConfig is the folder's code: without the flag it asks about that file (an
    empty answer is no, and the tokenizer loads all the same); trust_remote_code=False, or PreTrainedTokenizerFast,
    asks nothing."""
    folder = export_to(tmp_path / "hf", runs["mean"])
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    texts = [text for text in TEXTS if text]
    for no_flag in (False, True):
        done = subprocess.run([sys.executable, "-c", LOAD_TOKENIZER, str(folder), json.dumps(texts),
                               *(["no flag"] if no_flag else [])],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert ("[y/N]" in done.stdout + done.stderr) == no_flag, done.stdout + done.stderr
        results, imported = done.stdout.strip().splitlines()[-2:]  # the question, if asked, ends with no newline
        assert imported == "code from the folder: []"
        results = results.split("tokens: ")[1]
        embedder = load_embedder(str(runs["mean"]), "cpu")
        ours = embedder.tokenizer
        for got in json.loads(results).values():
            assert got["ids"] == [encode_example(ours, (text,), embedder.max_len) for text in texts]
            assert got["pair"] == encode_example(ours, ("a b", "c"), embedder.max_len)
            assert got["special"] == ["<s>", "</s>", "<pad>", "<mask>"]


def test_sentence_transformers_gives_our_embeddings(runs, tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    for kind in ("attention", "mean"):
        folder = export_to(tmp_path / kind, runs[kind])
        embedder = load_embedder(str(runs[kind]), "cpu")
        model = sentence_transformers.SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")
        assert model.max_seq_length == embedder.max_len
        for batch_size in (32, 2):  # another padding per batch
            vectors = model.encode(TEXTS, batch_size=batch_size, convert_to_tensor=True)
            torch.testing.assert_close(vectors, embedder.encode(TEXTS), atol=1e-5, rtol=0)


def test_gpt2_tokenizer_and_model_match_ours(tmp_path):
    """A BERT with the GPT-2 vocabulary, every weight moved off its init (so that a misplaced norm or projection
    shows), scaled embeddings and a head_dim of its own."""
    if not (default_tokenizer_dir() / R50K_FILENAME).exists():
        pytest.skip(f"no {R50K_FILENAME} in {default_tokenizer_dir()} (python setup/fetch_tokenizer.py)")
    argv = [f"dump_dir={tmp_path / 'run'}", "data.seq_len=48", "model.encoder.dim=32", "model.encoder.n_layers=2",
            "model.encoder.n_heads=2", "model.encoder.head_dim=8", "model.encoder.max_seqlen=64",
            "model.encoder.scale_embeddings=true"]
    params = {"app": BERT.name, "config": to_dict(load_config(BERT.args_cls, argv))}
    model, _, _ = build_from_params(params)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    checkpoint = save_consolidated(model, params, tmp_path / "run" / "consolidated.pt")
    folder = export_to(tmp_path / "hf", checkpoint)
    embedder = load_embedder(str(checkpoint), "cpu")
    assert_transformers_matches(folder, embedder)

    tokenizer, ours = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True), embedder.tokenizer
    rng = random.Random(0)
    alphabet = [chr(c) for c in [*range(32, 127), *range(160, 700), *range(0x3040, 0x30ff), 0x1F917, 10, 13, 9]]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    for text in TEXTS + fuzz + [(REPO / "README.md").read_text()[:5000]]:
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
        assert ids == [ours.bos_id, *ours.encode(text), ours.eos_id], text
    long = "word " * 100
    assert tokenizer(long, truncation=True)["input_ids"] == encode_example(ours, (long,), embedder.max_len)
    assert tokenizer("a b", "c")["input_ids"] == encode_example(ours, ("a b", "c"), embedder.max_len)
    assert tokenizer.decode(tokenizer(TEXTS[2])["input_ids"], skip_special_tokens=True) == TEXTS[2]
    # a masked-LM export parses <mask>, which takes the space before it, as a GPT-2 word does
    assert tokenizer("the <mask>.")["input_ids"] == [ours.bos_id, *ours.encode("the"), ours.mask_id,
                                                      *ours.encode("."), ours.eos_id]


def test_the_exported_code_needs_only_torch_and_transformers(runs, tmp_path):
    folder = export_to(tmp_path / "hf", runs["attention"])
    for path in folder.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
        assert imported <= {"math", "torch", "transformers"}, (path.name, imported)


def test_model_card_describes_the_run(runs, tmp_path):
    run = runs["attention"]
    results = {"layers": ["last"], "skipped": {},
               "tasks": {"sst2": {"n_train": 10, "n_dev": 5, "layers": {"last": {"linear": {
                   "score": 61.5, "metrics": {"acc": 61.5}, "best": {"lambda": 1.0, "train_size": 10}}}}}},
               "summary": {"last": {"linear": {"sst2": 61.5, "avg": 61.5}}}}
    (run / "glue_eval" / "consolidated").mkdir(parents=True)
    (run / "glue_eval" / "consolidated" / "results.json").write_text(json.dumps(results))
    try:
        card = (export_to(tmp_path / "hf", run) / "README.md").read_text()
    finally:
        shutil.rmtree(run / "glue_eval")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    model, _, _ = load_model(run)
    assert "apps.contrastive.train" in card and f"{last['data_tokens']:,} data tokens" in card
    assert f"{sum(p.numel() for p in model.encoder.parameters()):,} encoder" in card
    assert f"started from | `{runs['mean']}`" in card and "attention pooler" in card
    assert "61.5" in card and "SentenceTransformer(" in card


def test_one_line_errors(runs, tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    (tmp_path / "file").write_text("")
    out = f"out={tmp_path / 'hf'}"
    for argv, message in [([f"ckpt={tmp_path / 'none'}", out], "checkpoint not found"),
                          ([f"ckpt={tmp_path / 'notes.pt'}", out], "is not a checkpoint"),
                          ([out], "ckpt= and out= are required"),
                          ([f"ckpt={runs['mean']}", out, "pooling=max"], "pooling must be one of auto, mean"),
                          ([f"ckpt={runs['mean']}", out, "max_len=2"], "max_len must be 0"),
                          ([f"ckpt={runs['mean']}", f"out={tmp_path / 'file'}"], "is a file, not a folder")]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_folder_that_is_not_an_export_is_refused_and_left_untouched(runs, tmp_path, capsys):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "README.md").write_text("not a model card\n")
    with pytest.raises(SystemExit) as exit_info:
        main([f"ckpt={runs['mean']}", f"out={folder}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "not an export" in err, err
    assert len(err.strip().splitlines()) == 1 and str(folder) in err, err
    assert files_of(folder) == {"README.md": b"not a model card\n"} and sorted(tmp_path.iterdir()) == [folder]


def test_an_export_replaces_an_earlier_one_whole(runs, tmp_path):
    """No file of the earlier export stays (here one that the new export does not write, listed by the earlier
    one's marker) and nothing is left beside the folder."""
    folder = export_to(tmp_path / "hf", runs["attention"])
    (folder / "stale.bin").write_bytes(b"from an earlier export")
    (folder / MARKER).write_text(json.dumps({"files": [*json.loads((folder / MARKER).read_text())["files"],
                                                       "stale.bin"]}))
    export_to(folder, runs["mean"])
    listed = json.loads((folder / MARKER).read_text())["files"]
    assert sorted(files_of(folder)) == listed and "model.safetensors" in listed
    assert json.loads((folder / "config.json").read_text())["pooling"] == "mean"
    assert sorted(tmp_path.iterdir()) == [folder]


@pytest.mark.parametrize("added", ["in_the_export", "beside_it"])
def test_files_the_user_added_to_an_export_are_never_deleted(runs, tmp_path, capsys, added):
    """A re-export into an earlier export holding the user's files (a results file, a fine-tuned copy) used to
    delete them; so did any export beside a user's folder named like its partial copy. Refused in one line, and
    nothing changes."""
    folder = export_to(tmp_path / "hf", runs["attention"])
    where = folder if added == "in_the_export" else beside(folder)[0]
    (where / "finetuned").mkdir(parents=True)
    (where / "finetuned" / "model.safetensors").write_bytes(b"weights of mine")
    (where / "my_results.txt").write_text("0.93\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main([f"ckpt={runs['mean']}", f"out={folder}"])
    err = capsys.readouterr().err
    message = (f"out={folder} holds files that the earlier export did not write (finetuned, my_results.txt)"
               if added == "in_the_export" else f"{where} holds what this library did not write there")
    assert exit_info.value.code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def fail_on_weights(monkeypatch) -> None:
    """The export's write of model.safetensors fails, after its other files were written."""
    from lingua.export import hf_folder as export_module

    def atomic_write(path, data):
        if Path(path).name == "model.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, data)
    real = export_module.atomic_write
    monkeypatch.setattr(export_module, "atomic_write", atomic_write)


def test_a_failed_export_leaves_the_earlier_one_whole(runs, tmp_path, monkeypatch, capsys):
    folder = export_to(tmp_path / "hf", runs["attention"])
    earlier = files_of(folder)
    fail_on_weights(monkeypatch)
    with pytest.raises(SystemExit):
        main([f"ckpt={runs['mean']}", f"out={folder}"])
    assert "No space left on device" in capsys.readouterr().err
    assert files_of(folder) == earlier and sorted(tmp_path.iterdir()) == [folder]
    assert_transformers_matches(folder, load_embedder(str(runs["attention"]), "cpu"))


def test_an_export_killed_between_its_renames_is_repaired_by_the_next(runs, tmp_path, monkeypatch):
    """Killed after the earlier export went aside and before the new one came in: the next export puts the earlier
    one back before it starts (here it then fails, and the earlier one stays)."""
    folder = export_to(tmp_path / "hf", runs["attention"])
    earlier = files_of(folder)
    partial, previous = beside(folder)
    folder.rename(previous)
    partial.mkdir()
    (partial / MARKER).write_text(json.dumps({"files": [MARKER, "config.json"]}))  # written first
    (partial / "config.json").write_text("{}")
    fail_on_weights(monkeypatch)
    with pytest.raises(UserError, match="cannot write"):
        export_to(folder, runs["mean"])
    assert files_of(folder) == earlier and sorted(tmp_path.iterdir()) == [folder]


def test_a_run_folder_copied_to_another_machine_opens(tmp_path, monkeypatch):
    """A run trained with the GPT-2 file at machine A's path, copied to another path on a machine that keeps the
    file elsewhere (the run and A's file gone): export, the GLUE probes and init_from open the copy."""
    r50k = default_tokenizer_dir() / R50K_FILENAME
    if not r50k.exists():
        pytest.skip(f"no {R50K_FILENAME} in {default_tokenizer_dir()} (python setup/fetch_tokenizer.py)")
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    for machine in (machine_a, machine_b):
        machine.mkdir()
        shutil.copy(r50k, machine / R50K_FILENAME)
    data, run, copy = write_corpus(tmp_path / "data"), tmp_path / "run", tmp_path / "elsewhere" / "run"
    gpt2 = ["data.tokenizer.name=gpt2", f"data.tokenizer.path={machine_a / R50K_FILENAME}", "validation.every=0"]
    trained = run_to_the_end([sys.executable, "-m", "apps.bert.train", *tiny_argv(data, run, 2), *gpt2])  # machine A
    assert trained.returncode == 0, trained.stderr[-2000:]
    shutil.copytree(run, copy)
    shutil.rmtree(run)
    shutil.rmtree(machine_a)
    monkeypatch.setenv("LINGUA_TOKENIZER_DIR", str(machine_b))

    main([f"ckpt={copy}", f"out={tmp_path / 'hf'}"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 50261
    glue_command.main([f"ckpt={copy}", f"data={REPO / 'tests' / 'fixtures' / 'glue'}", "tasks=rte", "probes=linear"])
    assert list(copy.glob("glue_eval/*/results.json"))
    next_run = tmp_path / "next"
    here = ["data.tokenizer.name=gpt2", "validation.every=0", f"init_from={copy}"]
    train(BERT, load_config(BERT.args_cls, tiny_argv(data, next_run, 2) + here))
    assert (next_run / "consolidated.pt").exists() and not run.exists()


def test_an_earlier_export_whose_marker_cannot_be_read_is_said_so(runs, tmp_path, monkeypatch, capsys):
    """An I/O error reading the marker counted as "no marker": the export was refused as holding foreign files."""
    folder = export_to(tmp_path / "hf", runs["attention"])
    before = files_of(folder)

    class Unreadable(type(folder)):
        def read_bytes(self):
            raise OSError(errno.EIO, "Input/output error", str(self))
    monkeypatch.setattr(written_folder, "regular_file", lambda path, inside=None: Unreadable(path))
    with pytest.raises(SystemExit) as exit_info:
        main([f"ckpt={runs['mean']}", f"out={folder}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == f"error: cannot read {folder / MARKER}: Input/output error\n"
    assert files_of(folder) == before
