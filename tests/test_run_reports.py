"""What a run tells its user about its data and itself: a corpus smaller than a batch, malformed lines, the summary
line. Each case as it was found: a short training run, its log read as a user reads it."""

import json
import time

from conftest import tiny_argv, write_corpus

from apps.bert.train import APP
from lingua.args import load_config
from lingua.data import documents
from lingua.train import summary_line, train


def run(argv) -> dict:
    return train(APP, load_config(APP.args_cls, argv))


def test_a_corpus_smaller_than_a_batch_is_said_once_with_its_numbers(tmp_path):
    """One document of 4 tokens and batches of 8 x 32 tokens: each batch reads it 64 times, and each of those
    epochs logged a line (9,830 lines for 3 steps of the debug model)."""
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "train.00000.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    started = time.monotonic()
    run(tiny_argv(tmp_path / "data", tmp_path / "run", steps=3) + ["validation.every=0"])
    minutes = (time.monotonic() - started) / documents.EPOCH_LOG_INTERVAL_S
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    epochs = [line for line in log if "starts epoch" in line]
    assert 1 <= len(epochs) <= 1 + minutes, epochs
    small = [line for line in log if "smaller than a batch" in line]
    assert len(small) == 1, small
    assert "1 document(s), 4 tokens" in small[0] and "about 256 tokens" in small[0]
    assert "about 64.0 times" in small[0]


def test_a_malformed_first_line_is_reported_at_once_and_counted_in_the_progress_lines(tmp_path):
    """The first line of the first file is not JSON: a run of 2 steps never reaches the file's end, where it was
    reported."""
    data = write_corpus(tmp_path / "data")
    first = data / "tiny" / "train.00000.jsonl"
    first.write_text("{not json\n" + first.read_text())
    run(tiny_argv(data, tmp_path / "run", steps=2) + ["validation.every=0"])
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    reports = [line for line in log if "malformed line" in line and " | loss " not in line]
    assert len(reports) == 1, reports
    assert f"{first}: skipped a malformed line at byte 0 (not valid JSON (Expecting property name" in reports[0]
    progress = {line.split(" | ")[0].split()[-1]: line for line in log if " | loss " in line}
    assert progress["1/2"].endswith("| skipped 1 malformed lines"), progress
    assert "malformed" not in progress["2/2"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["malformed_lines"], r["new_malformed_lines"]) for r in records] == [(1, 1), (1, 0)]


def test_the_summary_line_is_written_for_people(tmp_path):
    summary = run(tiny_argv(write_corpus(tmp_path / "data"), tmp_path / "run", steps=4) + ["validation.every=0"])
    assert summary["stopped_by"] is None and summary["requeued"] is False  # the returned dict is unchanged
    line = next(line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "summary:" in line)
    assert "summary: 4 steps | 1,024 data tokens | " in line and line.endswith(" | stopped: no"), line
    assert f"first loss {summary['first_loss']:.3g} | final loss {summary['final_loss']:.3g}" in line
    assert "None" not in line and "False" not in line
    assert summary_line({"steps": 12000, "first_loss": None, "final_loss": None, "data_tokens": 1234567,
                         "seconds": 3600.04, "stopped_by": "SIGUSR2", "requeued": True}) == \
        "summary: 12,000 steps | 1,234,567 data tokens | 3,600.0 s | no loss logged | stopped: by SIGUSR2, requeued"
