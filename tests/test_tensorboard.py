"""TensorBoard event files beside metrics.jsonl (logging.tensorboard=true): the same numbers, a resume's purge, the
run lease's fence, a link refused, and a missing package named in one line before the start."""

import json
import sys

import numpy as np
import pytest
from conftest import tiny_argv
from test_faults import assert_one_line, run_main

from apps.bert.train import APP
from lingua.args import load_config
from lingua.errors import UserError
from lingua.metrics import LoggingArgs, MetricLogger
from lingua.run_folder import RunFolder
from lingua.train import train

EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

TENSORBOARD = LoggingArgs(tensorboard=True)


def scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of `folder`, by tag and step, as TensorBoard reads them (purges applied)."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_the_event_files_hold_every_number_of_metrics_jsonl(corpus, tmp_path):
    run = RunFolder(tmp_path / "run")
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, run.root, 4) + ["logging.tensorboard=true",
                                                                           "validation.every=2"]))
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    expected: dict[str, dict[int, float]] = {}
    for record in records:  # the training records and the validations'
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                expected.setdefault(key, {})[record["step"]] = float(np.float32(value))
    assert {"loss", "lr", "data_tokens", "compute_flops", "val/loss"} <= set(expected)
    assert scalars(run.tensorboard) == expected


def test_a_resume_replaces_the_steps_past_its_checkpoint(tmp_path):
    metrics, folder = tmp_path / "metrics.jsonl", tmp_path / "tensorboard"
    with MetricLogger(metrics, 0, TENSORBOARD, {}, tensorboard=folder) as first:
        for step in range(1, 5):
            first.log({"step": step, "loss": float(step)})
    with MetricLogger(metrics, 2, TENSORBOARD, {}, tensorboard=folder) as resumed:  # from the step-2 checkpoint
        for step in (3, 4):
            resumed.log({"step": step, "loss": 10.0 * step})
    assert len(list(folder.iterdir())) == 2  # one file per process
    assert scalars(folder) == {"loss": {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}}


def test_nothing_is_written_once_the_lease_is_lost(tmp_path):
    folder, lost = tmp_path / "tensorboard", [None]
    with MetricLogger(tmp_path / "metrics.jsonl", 0, TENSORBOARD, {}, fence=lambda: lost[0],
                      tensorboard=folder) as logger:
        logger.log({"step": 1, "loss": 1.0})
        lost[0] = "the run lease was taken over"
        logger.log({"step": 2, "loss": 2.0})
    assert logger.failure == "the run lease was taken over"
    assert scalars(folder) == {"loss": {1: 1.0}}


def test_a_link_at_the_event_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tensorboard").symlink_to(elsewhere)
    with pytest.raises(UserError, match="tensorboard: a symbolic link, which the library never writes through"):
        MetricLogger(tmp_path / "metrics.jsonl", 0, TENSORBOARD, {}, tensorboard=tmp_path / "tensorboard")
    assert list(elsewhere.iterdir()) == []


def test_tensorboard_asked_for_but_not_installed_is_one_line_before_the_start(corpus, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed (find_spec says so)
    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["logging.tensorboard=true"], capsys)
    assert status == 2
    assert_one_line(err, "logging.tensorboard is true but the tensorboard package is not installed")
    assert not (tmp_path / "run").exists()
