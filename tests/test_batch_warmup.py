"""Batch-size warm-up by gradient accumulation (lingua/training/batch_warmup.py): the micro-batches of each step, the
tokens and FLOPs counted during the ramp, and a resume in the middle of it."""

import shutil
from types import SimpleNamespace

import pytest
from conftest import read_metrics, tiny_argv, write_corpus
from test_faults import assert_one_line, run_main

from apps.bert.train import APP
from lingua import metrics
from lingua.app import load_model
from lingua.args import load_config
from lingua.errors import UserError
from lingua.metrics import Throughput
from lingua.train import train
from lingua.training.batch_warmup import BatchWarmupArgs, micro_batches_at

# tiny_argv's micro-batch: 8 rows of 32 tokens on one process. The batch grows from 1 to 4 micro-batches over 1536
# tokens: 1 micro-batch while fewer than 512 tokens are seen, 2 until 1024, 3 until 1536, then 4.
RAMP = ["grad_acc_steps=4", "batch_warmup.start=1", "batch_warmup.tokens=1536", "checkpoint.every=3"]
STEPS = 7
# by hand: 256 + 256 (1 micro-batch while < 512), + 512 (2 while < 1024), + 768 (3 while < 1536), then + 1024
DATA_TOKENS = [256, 512, 1024, 1792, 2816, 3840, 4864]


def test_the_micro_batches_of_each_stage_of_the_ramp():
    ramp = BatchWarmupArgs(start=2, tokens=3000)  # to 8 micro-batches: stages of 2, 4, 6, each 1000 tokens
    counts = {tokens: micro_batches_at(ramp, 8, tokens) for tokens in (0, 999, 1000, 1999, 2000, 2999, 3000, 10**9)}
    assert counts == {0: 2, 999: 2, 1000: 4, 1999: 4, 2000: 6, 2999: 6, 3000: 8, 10**9: 8}
    assert micro_batches_at(BatchWarmupArgs(), 8, 0) == 8  # no warm-up
    assert micro_batches_at(BatchWarmupArgs(start=8, tokens=100), 8, 0) == 8  # start at the target: nothing to grow


def test_a_ramp_that_cannot_be_is_one_line(corpus, tmp_path, capsys):
    with pytest.raises(UserError, match=r"'batch_warmup.start' must divide grad_acc_steps \(4\).*got 3"):
        load_config(APP.args_cls, tiny_argv(corpus, tmp_path, 2) + ["grad_acc_steps=4", "batch_warmup.start=3",
                                                                    "batch_warmup.tokens=10"])
    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["batch_warmup.start=1"], capsys)
    assert status == 2
    assert_one_line(err, "config key 'batch_warmup.tokens' must be > 0 when batch_warmup.start is set")


def test_throughput_counts_the_tokens_of_steps_of_different_sizes(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    model = SimpleNamespace(views_per_sequence=2, flops_per_token_view=lambda s: 10.0,
                            head_flops_per_token_view=lambda s: 1.0, hardware_flops_per_token_view=lambda s: 12.0)
    throughput = Throughput(model, rows_per_rank=8, row_tokens=32, seq_len=32, world_size=2, peak=1e3,
                            data_tokens=5000)  # a resumed run's count
    assert throughput.data_tokens(1) == 512 and throughput.data_tokens(3) == 1536
    clock[0] = 104.0  # steps of 1 and 3 micro-batches in 4 s
    record = throughput.report(5000 + 512 + 1536)
    assert record["data_tokens_per_s"] == 2048 / 4 and record["token_views_per_s"] == 2 * 2048 / 4
    assert record["mfu"] == 11.0 * 1024 / 2e3  # the head's FLOPs included, against both devices' peak
    clock[0] = 105.0
    assert throughput.report(5000 + 2048 + 2048)["data_tokens_per_s"] == 2048  # counted from the last report


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    """(the corpus, a run of STEPS steps through the ramp, checkpoints at steps 3 and 6)."""
    root = tmp_path_factory.mktemp("ramped")
    corpus, dump = write_corpus(root / "data"), root / "run"
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, dump, STEPS) + RAMP))
    return corpus, dump


def test_tokens_and_flops_of_each_step_of_the_ramp_are_exact(ramped):
    _, dump = ramped
    records = read_metrics(dump)
    assert [records[step]["data_tokens"] for step in range(1, STEPS + 1)] == DATA_TOKENS
    flops_per_token = load_model(dump)[0].flops_per_token_view(32)  # BERT: one view per token
    for step in range(1, STEPS + 1):
        assert records[step]["compute_flops"] == pytest.approx(DATA_TOKENS[step - 1] * flops_per_token, rel=1e-12)


def test_a_run_resumed_in_the_middle_of_the_ramp_takes_the_same_steps(ramped, tmp_path):
    corpus, full = ramped
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for later in ("0000000006", "0000000007"):  # back to step 3: 1024 tokens seen, 3 micro-batches next
        shutil.rmtree(resumed / "checkpoints" / later)
    (resumed / "consolidated.pt").unlink()
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, resumed, STEPS) + RAMP))
    reference, continued = read_metrics(full), read_metrics(resumed)
    assert sorted(continued) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert continued[step]["loss"] == reference[step]["loss"], step
        assert continued[step]["data_tokens"] == reference[step]["data_tokens"], step
