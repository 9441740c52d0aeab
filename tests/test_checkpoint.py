import torch

from lingua.checkpoint import CheckpointArgs, CheckpointManager


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
    state = {"step": 7, "data": {"pos": [1, 2]}}
    path = manager.save(7, model, optimizer, state, {"app": "x", "config": {}})
    other, other_opt = _model_and_optimizer(1)
    assert manager.load(path, other, other_opt) == state
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
