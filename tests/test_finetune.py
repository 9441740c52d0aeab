"""GLUE fine-tuning (apps/finetune): heads and poolings, every task on the fixture TSVs, the MNLI start, the best
epoch, exact resume, two ranks against one, bad inputs, the sweep and the table."""

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import kill_after_first_checkpoint_then_restart, read_metrics, run_to_the_end, tiny_argv

from apps.finetune import train as finetune
from apps.finetune.data import GlueDataArgs, GlueLoader, check_splits, decode_labels, label_codes, read_split
from apps.finetune.train import FinetuneTrainArgs
from lingua.app import load_model
from lingua.args import from_dict, load_config, to_dict
from lingua.checkpoint.store import Checkpoint
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.errors import UserError
from lingua.eval.glue_data import TASKS
from lingua.run_folder import RunFolder
from lingua.train import main, train
from lingua.training.resume import open_start
from tools.finetune import sweep, table

FIXTURES = Path(__file__).parent / "fixtures" / "glue"


def finetune_argv(dump_dir: Path, init_from: Path, task: str, *extra: str, data: Path = FIXTURES) -> list[str]:
    return [f"dump_dir={dump_dir}", f"init_from={init_from}", f"data.path={data}", f"data.task={task}",
            "data.seq_len=32", "data.batch_size=4", "epochs=3", "optim.lr=3e-3", "optim.decay=linear",
            "optim.lr_min=0", "optim.weight_decay=0", "logging.freq=1", "validation.batch_size=3", *extra]


def run_finetune(argv: list[str]):
    """The config the run trained with (its config.yaml) and its summary."""
    summary = train(finetune.APP, load_config(finetune.APP.args_cls, argv))
    dump_dir = Path(next(a for a in argv if a.startswith("dump_dir=")).partition("=")[2])
    return load_config(finetune.APP.args_cls, [f"config={dump_dir / 'config.yaml'}"]), summary


def validations(dump_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val/score" in r]


# ---------------------------------------------------------------------------------------------------------- data


def test_labels_travel_exactly_in_a_long_row():
    scores = torch.tensor([0.0, 3.8, 4.333333, 5.0])
    assert torch.equal(decode_labels(label_codes(scores), regression=True), scores)
    classes = torch.tensor([0, 2, 1])
    assert torch.equal(decode_labels(label_codes(classes), regression=False), classes)


def test_max_train_keeps_one_fixed_subset_of_the_training_split():

    args = GlueDataArgs(path=str(FIXTURES), task="rte", max_train=5)
    full, first, again = (read_split(GlueDataArgs(path=str(FIXTURES), task="rte"), "train"), read_split(args, "train"),
                          read_split(args, "train"))
    assert len(first.texts) == 5 and first.texts == again.texts and set(first.texts) < set(full.texts)
    assert len(read_split(args, "dev").texts) == len(read_split(GlueDataArgs(path=str(FIXTURES), task="rte"),
                                                                "dev").texts)  # the dev split stays whole


def test_batches_are_padded_to_their_longest_example_and_resume_on_other_world_sizes():
    args = GlueDataArgs(path=str(FIXTURES), task="sst2", seq_len=64, batch_size=2, seed=3,
                        tokenizer=TokenizerArgs(name="bytes"))
    tokenizer = build_tokenizer(args.tokenizer)
    one = GlueLoader(args, tokenizer, 0, 1, None)
    rows = [next(one) for _ in range(20)]  # 16 examples, 8 batches an epoch: two epochs and a half
    for batch in rows:
        real = (batch[:, 1:] != tokenizer.pad_id).sum(1)
        assert batch.shape[1] - 1 == 8 * -(-int(real.max()) // 8) and batch.shape[1] - 1 <= 64
    def examples(batches):
        return sorted(tuple(r[1:][r[1:] != tokenizer.pad_id].tolist()) for b in batches for r in b)

    assert examples(rows[:8]) == examples(rows[8:16]) == sorted(map(tuple, one.examples))  # each once an epoch
    assert [b[:, 1:5].tolist() for b in rows[:8]] != [b[:, 1:5].tolist() for b in rows[8:16]]  # a new order

    # two ranks of batch 1 read the same global batches as one rank of batch 2, and resume from its position
    halves = GlueDataArgs(**{**args.__dict__, "batch_size": 1})
    state = {"epoch": 1, "read": 4}
    ranks = [GlueLoader(halves, tokenizer, r, 2, state) for r in range(2)]
    resumed = GlueLoader(args, tokenizer, 0, 1, state)
    for _ in range(6):
        whole, parts = next(resumed), [next(loader) for loader in ranks]
        assert [row[1:][row[1:] != tokenizer.pad_id].tolist() for row in whole] == \
            [part[0, 1:][part[0, 1:] != tokenizer.pad_id].tolist() for part in parts]
    assert ranks[0].state_dict() == ranks[1].state_dict() == resumed.state_dict()


# ------------------------------------------------------------------------------------------- training, each task


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_trains_on_the_fixture_files(tiny_crossbert, tmp_path, task):
    config, summary = run_finetune(finetune_argv(tmp_path / task, tiny_crossbert, task, "epochs=6"))
    losses = read_metrics(tmp_path / task)
    steps = sorted(losses)
    assert summary["steps"] == config.steps == 6 * config.validation.every and config.validation.every >= 2
    assert config.model.num_labels == (len(TASKS[task].labels) or 1)
    assert sum(losses[s]["loss"] for s in steps[-4:]) < sum(losses[s]["loss"] for s in steps[:4])
    records = validations(tmp_path / task)
    assert [r["step"] for r in records] == [config.validation.every * (e + 1) for e in range(6)]
    assert set(records[0]) >= {"val/loss", "val/score", *(f"val/{m}" for m in TASKS[task].metrics)}


@pytest.mark.parametrize("pooling", ["mean", "first", "attention"])
def test_poolings_and_the_predictors_warm_start(tiny_crossbert, tmp_path, pooling):
    dump = tmp_path / pooling
    config, _ = run_finetune(finetune_argv(dump, tiny_crossbert, "sst2", f"model.pooling={pooling}", "epochs=1",
                                           "optim.lr=1e-9"))
    model, _, _ = load_model(dump)
    source, _, _ = load_model(tiny_crossbert)
    assert all(torch.allclose(v, source.encoder.state_dict()[k], atol=1e-6)
               for k, v in model.encoder.state_dict().items())
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0]])
    pad_mask = torch.ones_like(tokens, dtype=torch.bool)
    hidden = model.encoder.encode(tokens, pad_mask)
    expected = {"mean": hidden.mean(1), "first": hidden[:, 0]}.get(pooling)
    if pooling == "attention":  # warm-started from the predictor: the query is its mask embedding
        assert config.model.pooler.n_layers == source.predictor.args.n_layers
        assert torch.allclose(model.pooler.query, source.predictor.mask_embedding, atol=1e-6)
        expected = model.pooler.pooled(hidden, pad_mask)
    else:
        assert model.pooler is None
    torch.testing.assert_close(model.pooled(hidden, pad_mask), expected.float())
    torch.testing.assert_close(model.logits(tokens), model.head(expected.float()))


@pytest.mark.parametrize("source", ["bert", "electra", "contrastive"])
def test_every_kind_of_run_starts_a_fine_tuning(tiny_crossbert, tmp_path, source):
    """The backbone of BERT, ELECTRA (its discriminator) and a contrastive run (with its trained pooler)."""
    from conftest import write_corpus

    from apps.bert.train import APP as BERT
    from apps.contrastive import train as contrastive
    from apps.electra.train import APP as ELECTRA
    from tests.test_contrastive import contrastive_argv, write_triplets

    dump = tmp_path / source
    if source == "contrastive":
        argv = contrastive_argv(write_triplets(tmp_path / "t.jsonl", 16), dump, tiny_crossbert, 2, "model.frozen=false")
        train(contrastive.APP, load_config(contrastive.APP.args_cls, argv))
    else:
        app = {"bert": BERT, "electra": ELECTRA}[source]
        train(app, load_config(app.args_cls, tiny_argv(write_corpus(tmp_path / "data", 50), dump, 2)
                               + ["validation.every=0"]))
    run_finetune(finetune_argv(tmp_path / "ft", dump, "rte", "epochs=1", "optim.lr=1e-9", "model.pooling=attention"))
    source_model, tuned = load_model(dump)[0], load_model(tmp_path / "ft")[0]
    backbone = source_model.backbone.state_dict()
    assert all(torch.allclose(v, backbone[k], atol=1e-6) for k, v in tuned.encoder.state_dict().items())
    if source == "contrastive":  # its trained pooler starts this one's
        assert torch.allclose(tuned.pooler.query, source_model.pooler.query, atol=1e-6)


def test_a_cold_attention_pooler_when_the_source_offers_no_warm_start(tiny_crossbert, tmp_path):
    config, _ = run_finetune(finetune_argv(tmp_path / "cold", tiny_crossbert, "rte", "model.pooling=attention",
                                           "model.pooler.warm_start=false", "model.pooler.n_layers=2", "epochs=1"))
    assert config.model.pooler.n_layers == 2


def test_rte_starts_from_the_best_mnli_run(tiny_crossbert, tmp_path):
    run_finetune(finetune_argv(tmp_path / "mnli", tiny_crossbert, "mnli", "model.pooling=attention"))
    mnli, _, _ = load_model(tmp_path / "mnli" / "best.pt")
    config, _ = run_finetune(finetune_argv(tmp_path / "rte", tmp_path / "mnli" / "best.pt", "rte",
                                           "model.pooling=attention", "epochs=1", "optim.lr=1e-9"))
    rte, _, _ = load_model(tmp_path / "rte")
    assert mnli.head.out_features == 3 and rte.head.out_features == 2
    for part in ("encoder", "pooler"):
        saved = getattr(mnli, part).state_dict()
        assert all(torch.allclose(v, saved[k], atol=1e-6) for k, v in getattr(rte, part).state_dict().items()), part
    assert config.origin == str(Checkpoint.open(tiny_crossbert).path)  # through the MNLI run, to the pre-training


def test_the_best_epoch_is_kept(tiny_crossbert, tmp_path):
    dump = tmp_path / "run"
    run_finetune(finetune_argv(dump, tiny_crossbert, "cola", "epochs=5", "checkpoint.keep=0"))
    records = validations(dump)
    best = max(records, key=lambda r: r["val/score"])  # the first of equal scores: a later tie is no improvement
    assert json.loads((dump / "best.json").read_text()) == best
    kept, _, _ = load_model(dump / "best.pt")
    at_best, _, _ = load_model(dump / "checkpoints" / f"{best['step']:010d}")
    assert all(torch.equal(v, at_best.state_dict()[k]) for k, v in kept.state_dict().items())


def test_a_killed_run_resumes_exactly(tiny_crossbert, tmp_path):
    argv = finetune_argv(tmp_path / "straight", tiny_crossbert, "sst2", "epochs=8")
    run_finetune(argv)
    resumed = tmp_path / "resumed"
    kill_after_first_checkpoint_then_restart("apps.finetune.train", [
        a if not a.startswith("dump_dir=") else f"dump_dir={resumed}" for a in argv], resumed)
    straight, again = read_metrics(tmp_path / "straight"), read_metrics(resumed)
    assert [again[s]["loss"] for s in sorted(straight)] == [straight[s]["loss"] for s in sorted(straight)]
    assert validations(resumed) == validations(tmp_path / "straight")
    assert (resumed / "best.json").read_text() == (tmp_path / "straight" / "best.json").read_text()


def test_two_ranks_match_one_rank_with_the_whole_batch(tiny_crossbert, tmp_path):
    one = finetune_argv(tmp_path / "one", tiny_crossbert, "stsb", "data.batch_size=4", "epochs=2")
    done = run_to_the_end([sys.executable, "-m", "apps.finetune.train", *one])
    assert done.returncode == 0, done.stderr[-3000:]
    two = finetune_argv(tmp_path / "two", tiny_crossbert, "stsb", "data.batch_size=2", "epochs=2")
    done = run_to_the_end([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "apps.finetune.train", *two])
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert sorted(a) == sorted(b)
    for step in a:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4)
    for x, y in zip(validations(tmp_path / "one"), validations(tmp_path / "two"), strict=True):
        assert x == pytest.approx(y, rel=1e-4)


# ---------------------------------------------------------------------------------------------------- bad input


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_status:
        main(finetune.APP, argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_status.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_bad_inputs_are_one_line(tiny_crossbert, tmp_path, capsys):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES, glue)
    (glue / "QNLI" / "train.tsv").unlink()
    rte = (glue / "RTE" / "train.tsv").read_text().splitlines()
    (glue / "RTE" / "train.tsv").write_text("\n".join(rte[:3] + [rte[3].rsplit("\t", 1)[0] + "\tmaybe"] + rte[4:]))
    (glue / "MRPC" / "dev.tsv").unlink()
    cola = (glue / "CoLA" / "dev.tsv").read_text().splitlines()
    (glue / "CoLA" / "dev.tsv").write_text("\n".join(cola[:-1] + [cola[-1].replace("\t1\t", "\t7\t", 1)
                                                                  .replace("\t0\t", "\t7\t", 1)]))
    (tmp_path / "not_a_checkpoint.pt").write_bytes(b"hello")
    cases = {
        "data.task=glue": "unknown GLUE task 'glue'",
        "data.task=qnli": "QNLI: no train split",
        "data.task=rte": "RTE train: label 'maybe' is not one of the task's (entailment, not_entailment)",
        f"init_from={tmp_path / 'not_a_checkpoint.pt'}": "not_a_checkpoint.pt",
        f"init_from={tmp_path}": "no complete checkpoint, consolidated.pt or params.json",
        "model.pooling=cls": "pooling",
        "data.batch_size=20": "SST2: 16 training examples, fewer than one step's batch of 20",
        "data.task=mrpc": "MRPC: no dev split",
        "data.task=cola": "CoLA dev: label '7' is not one of the task's (0, 1)",
        "grad_acc_steps=2": "grad_acc_steps",
    }
    for override, message in cases.items():
        argv = finetune_argv(tmp_path / "run", tiny_crossbert, "sst2", data=glue) + [override]
        assert message in _error(argv, capsys), override
    assert not (tmp_path / "run").exists()  # nothing was started


def test_a_resume_on_another_number_of_processes_is_refused(tiny_crossbert, tmp_path):
    argv = finetune_argv(tmp_path / "run", tiny_crossbert, "rte", "epochs=1")
    run_finetune(argv)
    with pytest.raises(UserError, match="started with 4 steps an epoch, here 2: resume it on as many processes"):
        args = load_config(finetune.APP.args_cls, argv + ["data.batch_size=8"])  # as 2 of 4
        finetune.APP.configure(args, open_start(finetune.APP, args, RunFolder(Path(args.dump_dir)), 1))


def test_malformed_lines_are_reported_by_the_runs_reads_not_by_the_start_check(tmp_path, caplog):
    """The start's check reads both splits quietly; the run's own reads of them report their malformed lines."""
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES, glue)
    with open(glue / "RTE" / "train.tsv", "ab") as f:
        f.write(b"not\ta line of RTE's four fields\n")
    args = GlueDataArgs(path=str(glue), task="rte")
    check_splits(args)
    assert "malformed" not in caplog.text
    read_split(args, "train")
    assert caplog.text.count("skipped 1 malformed lines") == 1


def test_init_from_is_opened_once_and_configure_reads_no_file(tiny_crossbert, tmp_path, monkeypatch):
    """The start opens init_from once (its shapes, config and weights), and not at all for a resumed run; configure
    decides from the start alone, so it gives the same config with init_from and the GLUE files gone, for a new run
    and for a resumed one."""
    opened, original = [], Checkpoint.open.__func__
    monkeypatch.setattr(Checkpoint, "open", classmethod(lambda cls, path, app=None: opened.append(Path(path)) or
                                                        original(cls, path, app)))
    source, glue = tmp_path / "source", tmp_path / "glue"
    shutil.copytree(tiny_crossbert, source)
    shutil.copytree(FIXTURES, glue)
    argv = finetune_argv(tmp_path / "run", source, "rte", "epochs=1", data=glue)
    config, _ = run_finetune(argv)
    assert opened == [source]
    starts = {}
    for dump_dir in ("run", "new"):  # resumed (the steps are checked against its start) and new
        args = load_config(finetune.APP.args_cls, argv + [f"dump_dir={tmp_path / dump_dir}"])
        starts[dump_dir] = args, open_start(finetune.APP, args, RunFolder(Path(args.dump_dir)), 1)
    shutil.rmtree(source)
    # a resumed run has its own weights: init_from may go
    resumed = open_start(finetune.APP, starts["run"][0], RunFolder(tmp_path / "run"), 1)
    assert resumed.init_from is None and resumed.resumed is not None
    assert to_dict(finetune.APP.configure(starts["run"][0], resumed)) == to_dict(config)
    shutil.rmtree(glue)
    for dump_dir, (args, start) in starts.items():
        configured = finetune.APP.configure(args, start)
        assert to_dict(configured) == to_dict(replace(config, dump_dir=str(tmp_path / dump_dir)))


# ------------------------------------------------------------------------------------------- sweep and table


def _made_up_run(folder: Path, model: Path, task: str, lr: float, seed: int, score: float) -> None:
    folder.mkdir(parents=True)
    config = {"dump_dir": str(folder), "init_from": str(model), "origin": str(model), "seed": seed, "epochs": 3,
              "data": {"task": task}, "optim": {"lr": lr}, "validation": {"every": 10}}
    (folder / "config.yaml").write_text(json.dumps(to_dict(from_dict(FinetuneTrainArgs, config))))  # as a run writes it
    (folder / "best.json").write_text(json.dumps({"step": 20, "val/score": score}))
    (folder / "consolidated.pt").write_bytes(b"")  # finished


def test_the_table_takes_the_median_over_seeds_at_the_best_learning_rate(tiny_crossbert, tmp_path):
    scores = {("rte", 1e-4): [50.0, 70.0, 60.0], ("rte", 3e-5): [65.0, 64.0, 10.0], ("cola", 1e-4): [20.0]}
    for (task, lr), values in scores.items():
        for seed, score in enumerate(values):
            _made_up_run(tmp_path / f"{task}_{lr}_{seed}", tiny_crossbert, task, lr, seed, score)
    _made_up_run(tmp_path / "unfinished", tiny_crossbert, "sst2", 1e-4, 0, 90.0)
    (tmp_path / "unfinished" / "consolidated.pt").unlink()  # best.json is written at every new best
    results, unfinished = table.read_results([tmp_path])
    assert len(results) == 7 and unfinished == [tmp_path / "unfinished"]
    (chosen,) = table.choose(results).values()
    assert chosen["rte"]["lr"] == 3e-5 and chosen["rte"]["score"] == 64.0  # the medians: 64 against 60 (the means
    # would choose 1e-4: 60 against 46)
    assert chosen["rte"]["best_run"] == str(tmp_path / "rte_3e-05_0")
    assert chosen["cola"]["score"] == 20.0


def test_the_table_command_prints_the_paper_row_for_a_paper_shaped_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(table, "paper_app", lambda model: "crossbert")
    results = [table.Result("m/consolidated.pt", "rte", 1e-5, 0, 70.0, 2, tmp_path)]
    monkeypatch.setattr(table, "read_results", lambda folders: (results, []))
    table.main([str(tmp_path)])
    out = capsys.readouterr().out
    paper_row = next(line for line in out.splitlines() if "paper: CrossBERT" in line)
    assert paper_row.split()[2:] == ["-", "-", "-", "85.1", "-", "-", "-", "-", "85.1*"]  # RTE alone, averaged alike
    assert "86.6" not in out and "Metrics (dev, in %): RTE accuracy." in out and (tmp_path / "table.md").exists()


def test_the_sweep_file_and_the_mnli_start(tiny_crossbert, tmp_path):
    mnli = tmp_path / "mnli_sweep"
    for seed, score in enumerate([80.0, 82.0]):
        _made_up_run(mnli / f"mnli_{seed}", tiny_crossbert, "mnli", 2e-5, seed, score)
    args = sweep.SweepArgs(init_from=str(tiny_crossbert), dump_dir=str(tmp_path / "sw"), data=str(FIXTURES),
                           tasks=["rte", "sst2"], lrs=[1e-5, 2e-5], seeds=[0, 1], mnli_from=str(mnli))
    runs = sweep.sweep_spec(args)["runs"]
    assert [r["name"] for r in runs] == [f"{task}_lr{lr}_seed{seed}" for task in ("rte", "sst2")
                                         for lr in ("1e-05", "2e-05") for seed in (0, 1)]
    assert {r.get("init_from") for r in runs[:4]} == {str(mnli / "mnli_1" / "best.pt")}
    assert all("init_from" not in r for r in runs[4:])
    (mnli / "mnli_0" / "consolidated.pt").unlink()  # still training: its best.pt may still change
    with pytest.raises(UserError, match="MNLI runs that have not finished"):
        sweep.sweep_spec(args)


def test_the_sweep_runs_through_stool_and_the_table_collects_it(tiny_crossbert, tmp_path, capsys):
    sweep.main([f"init_from={tiny_crossbert}", f"dump_dir={tmp_path / 'sw'}", f"data={FIXTURES}", "tasks=stsb",
                "lrs=1e-3", "seeds=0,1", "epochs=1", "run_config=apps/finetune/configs/debug.yaml",
                "run_overrides=data.seq_len=32,data.batch_size=4", "cluster=local"])
    table.main([str(tmp_path / "sw")])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("crossbert")).split()
    assert row[1:8] == ["-"] * 7 and row[9] == row[8] + "*"  # STS-B alone, and the average over it
    assert len(table.read_results([tmp_path / "sw"])[0]) == 2  # two seeds


def test_the_paper_row_belongs_to_a_model_of_the_papers_shape(tmp_path, monkeypatch):
    class Opened:
        def __init__(self, app: str, dim: int):
            self.app_name, self.config = app, {"model": {"encoder": {"dim": dim, "n_layers": 28, "n_heads": 12}}}

    shapes = {"paper": ("apps.crossbert.train", 768), "small": ("apps.crossbert.train", 128),
              "contrastive": ("apps.contrastive.train", 768)}
    monkeypatch.setattr(table.Checkpoint, "open", lambda path: Opened(*shapes[Path(path).name]))
    for name in shapes:
        (tmp_path / name).mkdir()
    assert [table.paper_app(str(tmp_path / name)) for name in shapes] == ["crossbert", None, None]
