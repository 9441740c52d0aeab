import shutil

import pytest
import torch
from conftest import tiny_argv

from apps.bert.train import APP
from lingua.app import load_model
from lingua.args import load_config
from lingua.checkpoint.store import CheckpointArgs, CheckpointManager
from lingua.errors import UserError
from lingua.export.consolidate import main as checkpoint_main
from lingua.train import train


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_model_optimizer_and_state(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointArgs(keep=2))
    model, optimizer = _model_and_optimizer(0)
    state = {"step": 7, "data": {"pos": [1, 2]}, "data_tokens": 70}
    path = manager.save(7, model, optimizer, state, {"app": "x", "config": {}})
    other, other_opt = _model_and_optimizer(1)
    assert manager.load(path, other, other_opt) == [state]
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    exp_avg = lambda opt: [s["exp_avg"] for s in opt.state.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(exp_avg(optimizer), exp_avg(other_opt)))


def test_incomplete_checkpoint_is_ignored_and_old_ones_pruned(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointArgs(keep=2))
    model, optimizer = _model_and_optimizer(0)
    for step in (1, 2, 3):
        manager.save(step, model, optimizer, {"step": step}, {})
    (tmp_path / "0000000004.tmp").mkdir()  # a save killed half-way
    assert [p.name for p in manager.complete_checkpoints()] == ["0000000002", "0000000003"]
    assert manager.latest().name == "0000000003"


def _export(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_main(["consolidate", *map(str, argv)])
    return exit_info.value.code, capsys.readouterr().err


def test_export_answers_bad_inputs_in_one_line(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, dump, steps=2)))
    checkpoint_main(["consolidate", str(dump), str(tmp_path / "out.pt")])
    assert load_model(tmp_path / "out.pt")[0] is not None
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 64)
    damaged = tmp_path / "damaged"
    shutil.copytree(dump / "checkpoints" / "0000000002", damaged)
    (damaged / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "a_file").write_text("")
    for argv, message in [
        ([tmp_path / "junk.bin", tmp_path / "x.pt"], "junk.bin is a file; consolidate takes a checkpoint folder"),
        ([tmp_path, tmp_path / "x.pt"], "no complete checkpoint, consolidated.pt or params.json found"),
        ([damaged, tmp_path / "x.pt"], "is damaged: __0_0.distcp has 0 bytes"),
        ([dump, tmp_path / "a_file" / "x.pt"], "cannot write"),
    ]:
        status, err = _export(argv, capsys)
        assert status == 2 and err.startswith("error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("x.pt*"))


def test_load_model_refuses_files_that_are_not_checkpoints(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(UserError, match="is not a checkpoint of this library"):
        load_model(tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"is not a checkpoint \(torch.load: "):
        load_model(tmp_path / "text.pt")
