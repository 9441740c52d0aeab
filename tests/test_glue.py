import json
import logging
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from apps.bert.model import BertArgs
from apps.bert.train import BertTrainArgs
from apps.crossbert.model import CrossBertArgs
from apps.crossbert.train import CrossBertTrainArgs
from lingua.app import build_from_params
from lingua.args import to_dict
from lingua.checkpoint.store import CheckpointArgs, CheckpointManager, save_consolidated
from lingua.data.loader import DataArgs
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.errors import UserError
from lingua.eval import features, glue, glue_data
from lingua.model.transformer import TransformerArgs
from tools.eval import glue as glue_command

FIXTURES = Path(__file__).parent / "fixtures" / "glue"
REAL_GLUE = Path(__file__).parents[1] / ".." / "shared" / "data" / "glue"
CPU = torch.device("cpu")


class StandInEncoder(nn.Module):
    """The apps' `encode` contract with a mask-aware token mixing, so padding would show if it leaked in."""

    def __init__(self, vocab_size=260, dim=8, n_layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.calls = 0

    def encode(self, tokens, pad_mask=None, all_layers=False):
        self.calls += 1
        h, mask = self.emb(tokens), pad_mask.unsqueeze(-1).float()
        outputs = []
        for layer in self.layers:
            context = (h * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
            h = torch.tanh(layer(h) + context)
            outputs.append(h)
        return outputs if all_layers else outputs[-1]


@pytest.fixture
def tokenizer():
    return build_tokenizer(TokenizerArgs(name="bytes"))


def _args(**overrides) -> glue.GlueEvalArgs:
    return replace(glue.GlueEvalArgs(data=str(FIXTURES), max_len=64, batch_size=4), **overrides)


@pytest.mark.parametrize("name", list(glue_data.TASKS))
def test_every_task_format_parses(name):
    task = glue_data.TASKS[name]
    train, dev = glue_data.load_split(task, "train", str(FIXTURES)), glue_data.load_split(task, "dev", str(FIXTURES))
    assert (len(train.texts), len(dev.texts)) == (16, 8)
    for split in (train, dev):
        assert all(len(t) == len(task.text_columns) and all(t) for t in split.texts)
        if task.regression:
            assert split.labels.dtype == torch.float32 and 0 <= split.labels.min() <= split.labels.max() <= 5
        else:
            assert split.labels.dtype == torch.long and set(split.labels.tolist()) == set(range(len(task.labels)))
    assert train.skipped == (2 if name == "qqp" else 0)  # QQP's line broken in two


def test_format_details():
    sst = glue_data.load_split(glue_data.TASKS["sst2"], "train", str(FIXTURES))
    assert sst.texts[0][0].startswith('" a dull film')  # the lone quote is text, not CSV quoting
    cola = glue_data.load_split(glue_data.TASKS["cola"], "dev", str(FIXTURES))
    assert cola.texts[0] == ("today reads the cat",) and cola.labels[:2].tolist() == [0, 1]  # no header line
    mrpc = glue_data.load_split(glue_data.TASKS["mrpc"], "dev", str(FIXTURES))  # header behind a byte-order mark
    assert mrpc.texts[0] == ("a dog sings today .", "a dog sings today .") and mrpc.labels[0] == 1
    mnli = glue_data.load_split(glue_data.TASKS["mnli"], "dev", str(FIXTURES))  # dev_matched, five annotator labels
    assert mnli.texts[1] == ("the child sings today", "a bird sings today") and mnli.labels[:3].tolist() == [0, 1, 2]
    stsb = glue_data.load_split(glue_data.TASKS["stsb"], "dev", str(FIXTURES))
    assert stsb.labels[:2].tolist() == [5.0, 3.0]
    rte = glue_data.load_split(glue_data.TASKS["rte"], "dev", str(FIXTURES))
    assert rte.labels[:2].tolist() == [0, 1]  # entailment, not_entailment


def test_wrong_file_and_missing_split(tmp_path):
    shutil.copytree(FIXTURES / "SST-2", tmp_path / "RTE")  # SST-2's columns where RTE's are expected
    with pytest.raises(UserError, match="no column 'sentence1'"):
        glue_data.load_split(glue_data.TASKS["rte"], "train", str(tmp_path))
    with pytest.raises(glue_data.MissingSplit, match="no train split"):
        glue_data.load_split(glue_data.TASKS["qnli"], "train", str(tmp_path))
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_bytes(b"sentence\tlabel\n\xff\xfe\x00\t1\nno label\n")
    with pytest.raises(UserError) as error:  # nothing usable is left: the file is refused in one line
        glue_data.load_split(glue_data.TASKS["sst2"], "train", str(tmp_path))
    assert str(error.value) == (f"{tmp_path / 'SST-2' / 'train.tsv'} has no usable SST2 example "
                                "(2 malformed lines, the first at line 2)")
    (tmp_path / "SST-2" / "train.tsv").write_bytes(b"sentence\xff\tlabel\ngood\t1\n")
    with pytest.raises(UserError, match="is not a GLUE TSV file"):
        glue_data.load_split(glue_data.TASKS["sst2"], "train", str(tmp_path))


def _sst2_train(folder: Path, extra_lines: list[bytes]) -> Path:
    """The fixture's SST-2 train split (a header and 16 rows) with extra lines after its second row."""
    lines = (FIXTURES / "SST-2" / "train.tsv").read_bytes().splitlines(keepends=True)
    (folder / "SST-2").mkdir()
    (folder / "SST-2" / "train.tsv").write_bytes(b"".join(lines[:3] + extra_lines + lines[3:]))
    return folder / "SST-2" / "train.tsv"


def test_bad_rows_of_a_tsv_are_skipped_counted_and_reported_once(tmp_path, caplog):
    long_sentence = "a long review " + "x" * 200_000  # past csv's 128 KB field size limit
    path = _sst2_train(tmp_path, [b"caf\xe9 au lait\t1\n", f"{long_sentence}\t0\n".encode()])
    with caplog.at_level(logging.WARNING):
        report = glue_data.SkippedLinesReport()  # a training run's probes keep one
        split = glue_data.load_split(glue_data.TASKS["sst2"], "train", str(tmp_path), report=report)
        # the next evaluation
        again = glue_data.load_split(glue_data.TASKS["sst2"], "train", str(tmp_path), report=report)
    assert (split.skipped, split.first_skipped, len(split.texts)) == (1, "line 4", 17)
    assert split.texts[2] == (long_sentence,) and split.labels[2] == 0 and again.texts == split.texts
    assert [r.getMessage() for r in caplog.records] == [f"SST2 train: {path}: skipped 1 malformed lines "
                                                        "(the first at line 4)"]


def test_a_lone_carriage_return_stays_inside_its_sentence(tmp_path):
    _sst2_train(tmp_path, [b"a sentence\rthat goes on\t1\n", b"a windows line\t0\r\n"])
    split = glue_data.load_split(glue_data.TASKS["sst2"], "train", str(tmp_path))
    assert split.skipped == 0 and len(split.texts) == 18
    assert split.texts[2:4] == [("a sentence\rthat goes on",), ("a windows line",)]
    assert split.labels[2:4].tolist() == [1, 0]


def test_non_finite_scores_are_malformed_rows(tmp_path):
    (tmp_path / "STS-B").mkdir()
    lines = (FIXTURES / "STS-B" / "train.tsv").read_text().splitlines()
    for i, bad in ((1, "nan"), (2, "inf"), (3, "-Infinity")):
        lines[i] = lines[i].rsplit("\t", 1)[0] + "\t" + bad
    (tmp_path / "STS-B" / "train.tsv").write_text("\n".join(lines) + "\n")
    split = glue_data.load_split(glue_data.TASKS["stsb"], "train", str(tmp_path))
    assert split.skipped == 3 and len(split.texts) == 13 and torch.isfinite(split.labels).all()
    rows = [{"sentence1": "a", "sentence2": "b", "label": float("nan")},
            {"sentence1": "c", "sentence2": "d", "label": 1.0}]
    hf = glue_data.split_from_hf_rows(glue_data.TASKS["stsb"], rows)
    assert hf.skipped == 1 and hf.labels.tolist() == [1.0]


def _fake_datasets(calls):
    rows = {"validation_matched": [{"premise": "p1", "hypothesis": "h1", "label": 2},
                                   {"premise": "p2", "hypothesis": "h2", "label": -1}],
            "train": [{"sentence1": "a", "sentence2": "b", "label": 3.5}]}

    def load_dataset(path, name, split):
        calls.append((path, name, split))
        return rows[split]

    return types.SimpleNamespace(load_dataset=load_dataset)


def test_hf_rows_are_converted(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(calls))
    mnli = glue_data.load_split(glue_data.TASKS["mnli"], "dev", "hf")
    assert mnli.texts == [("p1", "h1")] and mnli.labels.tolist() == [2] and mnli.skipped == 1  # -1: unlabelled
    stsb = glue_data.load_split(glue_data.TASKS["stsb"], "train", "hf")
    assert stsb.texts == [("a", "b")] and stsb.labels.tolist() == [3.5]
    assert calls == [("nyu-mll/glue", "mnli", "validation_matched"), ("nyu-mll/glue", "stsb", "train")]


def test_hf_without_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UserError, match="pip install datasets"):
        glue_data.load_split(glue_data.TASKS["sst2"], "dev", "hf")


def test_examples_are_encoded_roberta_style_and_truncated(tokenizer):
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    assert features.encode_example(tokenizer, ("ab",), 16) == [bos, 97, 98, eos]
    assert features.encode_example(tokenizer, ("ab", "c"), 16) == [bos, 97, 98, eos, eos, 99, eos]
    assert features.encode_example(tokenizer, ("abcdef",), 5) == [bos, 97, 98, 99, eos]
    # pairs: the longer sentence is shortened first, and both keep at least half the budget when both are long
    assert features.encode_example(tokenizer, ("abcdefgh", "x"), 8) == [bos, 97, 98, 99, eos, eos, 120, eos]
    assert len(features.encode_example(tokenizer, ("a" * 50, "b" * 50), 12)) == 12


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert features.mean_pool(hidden, torch.tensor([[True, True, False]])).tolist() == [[2.0, 3.0]]


def test_features_do_not_depend_on_batching_or_padding(tokenizer):
    model = StandInEncoder().eval()
    texts = [("a",), ("a much longer sentence",), ("mid size", "pair"), ("zz",)]
    batched = features.extract_features(model, tokenizer, texts, ["last", "0"], 64, 3, CPU)
    alone = features.extract_features(model, tokenizer, texts, ["last", "0"], 64, 1, CPU)
    for layer in ("last", "0"):
        torch.testing.assert_close(batched[layer], alone[layer])
    assert batched["last"].shape == (4, 8) and not torch.allclose(batched["last"], batched["0"])
    # in the original order: the first row is the features of ("a",) alone
    single = features.extract_features(model, tokenizer, [("a",)], ["last"], 64, 1, CPU)["last"]
    torch.testing.assert_close(batched["last"][0], single[0])


def test_layer_specs(tokenizer):
    model = StandInEncoder(n_layers=3)
    assert features.resolve_layers("last", model, tokenizer, CPU) == ["last"]
    assert features.resolve_layers("all", model, tokenizer, CPU) == ["0", "1", "2"]
    assert features.resolve_layers("0,-1,last", model, tokenizer, CPU) == ["0", "2", "last"]
    with pytest.raises(UserError, match="out of range"):
        features.resolve_layers("3", model, tokenizer, CPU)


def test_evaluate_reuses_cached_features_per_model(tokenizer, tmp_path):
    model = StandInEncoder()
    args = _args(tasks=["sst2", "stsb"], probes=["linear"])
    first = glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a"))
    calls = model.calls
    again = glue.evaluate_glue(model, tokenizer, replace(args, probes=["knn", "linear"]), CPU,
                               features.FeatureCache(tmp_path, "model-a"))
    assert model.calls == calls  # no forward pass: every split and layer came from the cache
    assert again["summary"]["last"]["linear"] == first["summary"]["last"]["linear"]
    glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a-step-2"))
    assert model.calls > calls  # another checkpoint identity: features recomputed


def test_a_torn_cache_file_is_recomputed(tokenizer, tmp_path):
    model = StandInEncoder()
    args = _args(tasks=["sst2"], probes=["linear"])
    first = glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a"))
    torn = sorted(tmp_path.glob("sst2.train.*.pt"))[0]
    torn.write_bytes(torn.read_bytes()[:100])  # a crash half-way through writing it
    calls = model.calls
    again = glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a"))
    assert model.calls == calls + 4  # the torn split alone (16 examples, batches of 4) is encoded again
    assert again["summary"] == first["summary"] and torch.load(torn, weights_only=True)["features"].shape[0] == 16


@pytest.mark.parametrize("alteration", ["bytes", "dict", "shape"])
def test_an_altered_cache_file_is_recomputed(tokenizer, tmp_path, alteration):
    model = StandInEncoder()
    args = _args(tasks=["sst2"], probes=["linear"])
    first = glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a"))
    cached = sorted(tmp_path.glob("sst2.train.*.pt"))[0]
    saved = torch.load(cached, weights_only=True)
    if alteration == "bytes":  # same size, other values
        torch.save({**saved, "features": saved["features"].flip(0)}, cached)
    elif alteration == "dict":
        torch.save({"a": 1}, cached)
    else:
        fewer = saved["features"][:3]
        torch.save({"features": fewer, "sha256": features._checksum(fewer)}, cached)
    again = glue.evaluate_glue(model, tokenizer, args, CPU, features.FeatureCache(tmp_path, "model-a"))
    assert again["summary"] == first["summary"]


def test_training_hook_restores_train_mode_and_returns_flat_metrics(tokenizer):
    model = StandInEncoder().train()
    metrics = glue.run_glue_probes(model, tokenizer, _args(tasks=["rte", "cola"], layers="0,last"), CPU)
    assert model.training
    assert {"glue/rte/linear", "glue/cola/knn", "glue/avg/linear", "glue/rte/knn/layer0"} <= set(metrics)
    assert metrics["glue/avg/linear"] == pytest.approx((metrics["glue/rte/linear"] + metrics["glue/cola/linear"]) / 2)


def test_probe_results_keep_the_whole_curve(tokenizer):
    results = glue.evaluate_glue(StandInEncoder(), tokenizer, _args(tasks=["mrpc", "stsb"]), CPU)
    linear = results["tasks"]["mrpc"]["layers"]["last"]["linear"]
    assert linear["curve"]["train_sizes"] == [1, 10, 16] and len(linear["curve"]["lambdas"]) == 9
    assert len(linear["curve"]["scores"]["f1"]) == 3 and len(linear["curve"]["scores"]["acc"][0]) == 9
    assert linear["score"] == max(linear["curve"]["scores"]["acc"][-1])
    knn = results["tasks"]["stsb"]["layers"]["last"]["knn"]
    assert set(knn["grid"]) == {"l2", "cosine"} and set(knn["grid"]["l2"]) == {"1", "3", "10", "30"}
    assert knn["score"] == max(s["spearman"] for d in knn["grid"].values() for s in d.values())


def test_bad_settings_are_user_errors(tokenizer):
    for overrides, message in [({"data": ""}, "data= is required"), ({"data": "/no/such/dir"}, "not found"),
                               ({"tasks": ["sst3"]}, "unknown GLUE task 'sst3'"),
                               ({"probes": ["mlp"]}, "unknown probe 'mlp'"), ({"layers": "x"}, "layers:")]:
        with pytest.raises(UserError, match=message):
            glue.evaluate_glue(StandInEncoder(), tokenizer, _args(**overrides), CPU)


def tiny_run(run_dir: Path, app: str = "bert", consolidated: bool = True) -> Path:
    """A real checkpoint of a tiny (untrained) model with the byte tokenizer: a consolidated export, or a DCP
    checkpoint folder under run_dir/checkpoints. Returns the file or folder."""
    encoder = TransformerArgs(dim=32, n_layers=2, n_heads=2, max_seqlen=64)
    data = DataArgs(seq_len=64, tokenizer=TokenizerArgs(name="bytes"))
    if app == "bert":
        args = BertTrainArgs(dump_dir=str(run_dir), data=data, model=BertArgs(encoder=encoder))
    else:
        args = CrossBertTrainArgs(dump_dir=str(run_dir), data=data, model=CrossBertArgs(encoder=encoder))
    params = {"app": f"apps.{app}.train", "config": to_dict(args)}
    torch.manual_seed(0)
    model, _, _ = build_from_params(params)
    run_dir.mkdir(parents=True)
    if consolidated:
        return save_consolidated(model, params, run_dir / "consolidated.pt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return CheckpointManager(run_dir / "checkpoints", CheckpointArgs()).save(10, model, optimizer, {}, params)


def test_command_end_to_end(tmp_path, capsys):
    shutil.copytree(FIXTURES, tmp_path / "glue")
    (tmp_path / "glue" / "QNLI" / "train.tsv").unlink()  # like the real data here: QNLI has no train split
    checkpoint = tiny_run(tmp_path / "run")
    glue_command.main([f"ckpt={tmp_path / 'run'}", f"data={tmp_path / 'glue'}", "probes=linear,knn"])
    out = capsys.readouterr().out
    table = out[out.index("probe  "):].splitlines()
    assert table[0].split() == ["probe", "MNLI", "QNLI", "QQP", "RTE", "SST2", "MRPC", "CoLA", "STSB", "Avg."]
    assert table[1].split()[:3] == ["linear", table[1].split()[1], "-"] and table[2].startswith("knn")
    assert "QNLI (no train split" in out
    results = json.loads((tmp_path / "run" / "glue_eval" / "consolidated" / "results.json").read_text())
    assert results["checkpoint"] == str(checkpoint) and results["args"]["max_len"] == 64
    assert set(results["tasks"]) == set(glue_data.TASKS) - {"qnli"} and "qnli" in results["skipped"]
    assert results["tasks"]["qqp"]["skipped_lines"] == {"train": 2, "dev": 0}
    scores = results["summary"]["last"]["linear"]
    assert scores["avg"] == pytest.approx(sum(v for k, v in scores.items() if k != "avg") / 7)
    assert len(list((tmp_path / "run" / "glue_eval" / "cache").glob("*.pt"))) == 14  # 7 tasks x 2 splits


def test_command_on_a_crossbert_checkpoint_folder(tmp_path, capsys):
    checkpoint = tiny_run(tmp_path / "run", app="crossbert", consolidated=False)
    glue_command.main([f"ckpt={tmp_path / 'run'}", f"data={FIXTURES}", "tasks=sst2,stsb", "layers=all"])
    results = json.loads((tmp_path / "run" / "glue_eval" / checkpoint.name / "results.json").read_text())
    assert results["checkpoint"] == str(checkpoint) and results["layers"] == ["0", "1"]
    assert set(results["summary"]["1"]["knn"]) == {"sst2", "stsb", "avg"}
    assert "linear L0" in capsys.readouterr().out


def test_command_errors_are_one_line(tmp_path, capsys):
    tiny_run(tmp_path / "run")
    for argv, message in [([f"ckpt={tmp_path / 'none'}", f"data={FIXTURES}"], "checkpoint not found"),
                          ([f"data={FIXTURES}"], "ckpt= is required"),
                          ([f"ckpt={tmp_path / 'run'}", f"data={FIXTURES}", "device=tpu"], "device must be auto, cpu"),
                          ([f"ckpt={tmp_path / 'none'}", f"data={FIXTURES}", "knn_k=0,1"], "must be >= 1")]:
        with pytest.raises(SystemExit) as exit_info:
            glue_command.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_command_on_files_that_are_not_checkpoints(tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    damaged = tiny_run(tmp_path / "run", consolidated=False)
    (damaged / "__0_0.distcp").write_bytes((damaged / "__0_0.distcp").read_bytes()[:1000])
    for ckpt, message in [(tmp_path / "notes.pt", "is not a checkpoint"),
                          (tmp_path / "tensor.pt", "is not a checkpoint"),
                          (damaged, "is damaged: __0_0.distcp has 1000 bytes")]:
        with pytest.raises(SystemExit) as exit_info:
            glue_command.main([f"ckpt={ckpt}", f"data={FIXTURES}", "tasks=sst2"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_command_with_an_unwritable_output(tmp_path, capsys):
    tiny_run(tmp_path / "run")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        glue_command.main([f"ckpt={tmp_path / 'run'}", f"data={FIXTURES}", "tasks=sst2", "probes=linear",
                           f"out={tmp_path / 'file' / 'results.json'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cannot write" in err and len(err.strip().splitlines()) == 1


REAL_ROWS = {"cola": (8551, 1043), "sst2": (20000, 872), "mrpc": (3668, 408), "stsb": (5749, 1500),
             "rte": (2490, 277)}


@pytest.mark.skipif(not REAL_GLUE.is_dir(), reason="real GLUE files not present")
def test_real_glue_files_parse_completely():
    for name, (n_train, n_dev) in REAL_ROWS.items():
        train = glue_data.load_split(glue_data.TASKS[name], "train", str(REAL_GLUE))
        dev = glue_data.load_split(glue_data.TASKS[name], "dev", str(REAL_GLUE))
        assert (len(train.texts), len(dev.texts), train.skipped, dev.skipped) == (n_train, n_dev, 0, 0), name
    assert len(glue_data.load_split(glue_data.TASKS["qnli"], "dev", str(REAL_GLUE)).texts) == 5463
    with pytest.raises(glue_data.MissingSplit):
        glue_data.load_split(glue_data.TASKS["qnli"], "train", str(REAL_GLUE))


@pytest.mark.skipif(not REAL_GLUE.is_dir(), reason="real GLUE files not present")
def test_command_on_real_glue(tmp_path, capsys):
    tiny_run(tmp_path / "run")
    glue_command.main([f"ckpt={tmp_path / 'run'}", f"data={REAL_GLUE}", "tasks=rte,mrpc,qnli", "max_train=300",
                       f"out={tmp_path / 'scores.json'}"])
    results = json.loads((tmp_path / "scores.json").read_text())
    assert set(results["tasks"]) == {"rte", "mrpc"} and "qnli" in results["skipped"]
    assert results["tasks"]["rte"]["n_train"] == 300 and results["tasks"]["rte"]["n_dev"] == 277
    assert "MRPC" in capsys.readouterr().out
