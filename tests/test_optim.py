import math

import pytest
import torch

from lingua.errors import UserError
from lingua.model.transformer import Encoder, TransformerArgs, init_weights
from lingua.training.optim import OptimArgs, lr_at, param_groups


def test_schedule_warmup_then_cosine_to_min():
    args = OptimArgs(lr=1e-3, lr_min=1e-6, warmup=10)
    lrs = [lr_at(s, args, total_steps=110) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[60] == pytest.approx(1e-6 + 0.5 * (1e-3 - 1e-6))  # half-way through the decay
    assert lr_at(110, args, 110) == pytest.approx(1e-6) and lr_at(500, args, 110) == pytest.approx(1e-6)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = Encoder(TransformerArgs(dim=16, n_layers=1, n_heads=2, max_seqlen=8), vocab_size=10)
    model.bias_holder = torch.nn.Linear(16, 16, bias=True)
    init_weights(model, 0.02)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {
        "tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "norm.weight",
        "bias_holder.bias",
    }
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])


def test_lr_min_above_lr_is_an_error():
    with pytest.raises(UserError, match="lr_min"):
        OptimArgs(lr=1e-4, lr_min=1e-3)


def test_gradient_clipping_caps_the_norm():
    from lingua.training.step import clip_gradients

    model = torch.nn.Linear(4, 4)
    (model(torch.ones(1, 4)) * 100).sum().backward()
    norm = clip_gradients(model, 1.0)
    assert norm > 1.0
    total = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.parameters()))
    assert total == pytest.approx(1.0, rel=1e-4)



def _trained(implementation: str, steps: int = 3, start: tuple[dict, dict] | None = None):
    """A tiny encoder after `steps` AdamW steps, from the model and optimizer states `start` when given. The gradients
    are fixed draws, not the model's: a model's own gradients would grow the kernels' last-bit differences from step
    to step."""
    from lingua.training.optim import build_optimizer

    torch.manual_seed(0)
    model = Encoder(TransformerArgs(dim=16, n_layers=1, n_heads=2, max_seqlen=8), vocab_size=10)
    init_weights(model, 0.02)
    optimizer = build_optimizer(model, OptimArgs(lr=1e-2, warmup=0, implementation=implementation))
    if start is not None:
        model.load_state_dict(start[0])
        optimizer.load_state_dict(start[1])
    done = 0 if start is None else next(iter(optimizer.state.values()))["step"].int().item()
    for step in range(done, done + steps):
        draws = torch.Generator().manual_seed(step)  # step n's gradients, whichever run takes it
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=draws) * 1e-3
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def test_fused_adamw_steps_as_foreach_does():
    fused, fused_optimizer = _trained("fused")
    assert fused_optimizer.defaults["fused"]  # the CPU has torch's fused AdamW
    foreach, _ = _trained("foreach")
    loop, _ = _trained("for-loop")
    for a, b, c in zip(fused.parameters(), foreach.parameters(), loop.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-7)


def test_an_optimizer_state_moves_between_fused_and_foreach():
    """Their states hold the same tensors (step, exp_avg, exp_avg_sq), so a checkpoint of one resumes with the other:
    3 steps of one then 2 of the other end where 5 of the first do."""
    for saved_by, loaded_by in (("foreach", "fused"), ("fused", "foreach")):
        model, optimizer = _trained(saved_by, steps=3)
        resumed, _ = _trained(loaded_by, steps=2, start=(model.state_dict(), optimizer.state_dict()))
        straight, _ = _trained(saved_by, steps=5)
        for a, b in zip(resumed.parameters(), straight.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_unknown_implementation_is_an_error():
    with pytest.raises(UserError, match="implementation"):
        OptimArgs(implementation="apex")


def test_a_profile_names_the_optimizer_step():
    from lingua.training.step import training_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.linear(x).pow(2).mean(), {}

        def predicted_tokens(self, batch):
            return batch["x"].shape[0]

    model = Tiny()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        training_step(model, torch.optim.AdamW(model.parameters()), [{"x": torch.ones(2, 4)}], clip=1.0)
    assert "optimizer" in {event.name for event in profile.events()}


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_learning_rate_at_every_phase_boundary(shape):
    """Warm-up to the peak, stable at the peak up to the decay's first step, then the shape down to lr_min."""
    args = OptimArgs(lr=1e-3, lr_min=1e-5, warmup=10, schedule="wsd", decay=shape, decay_steps=20)
    lrs = [lr_at(s, args, total_steps=100) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # warm-up
    assert lrs[10:81] == [1e-3] * 71  # stable, the decay's first step included (progress 0)
    half = {"linear": 0.5, "cosine": 0.5, "1-sqrt": 1 - math.sqrt(0.5)}[shape]
    assert lrs[90] == pytest.approx(1e-5 + half * (1e-3 - 1e-5))  # half-way through the decay
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    assert lr_at(100, args, 100) == pytest.approx(1e-5) and lr_at(150, args, 100) == pytest.approx(1e-5)


def test_wsd_decay_as_a_fraction_and_a_stable_run():
    fraction = OptimArgs(lr=1e-3, warmup=0, schedule="wsd", decay="linear", decay_fraction=0.25)
    assert fraction.decay_window(200) == (150, 50)
    assert lr_at(149, fraction, 200) == 1e-3 and lr_at(175, fraction, 200) == pytest.approx(1e-6 + 0.5 * (1e-3 - 1e-6))
    stable = OptimArgs(lr=1e-3, warmup=5, schedule="wsd", decay_fraction=0.0)
    assert [lr_at(s, stable, 50) for s in range(5, 50)] == [1e-3] * 45


def test_a_wsd_branch_follows_its_stable_runs_learning_rate():
    """A branch of N + K steps decaying over its last K has the stable run's learning rate for its first N steps."""
    stable = OptimArgs(lr=1e-3, warmup=10, schedule="wsd", decay_fraction=0.0)
    branch = OptimArgs(lr=1e-3, warmup=10, schedule="wsd", decay_steps=15)
    assert [lr_at(s, branch, 75) for s in range(60)] == [lr_at(s, stable, 400) for s in range(60)]


def test_the_default_schedule_is_unchanged_bitwise():
    args = OptimArgs(lr=1e-3, lr_min=1e-6, warmup=10)
    for step in range(0, 120, 7):
        expected = args.lr * (step + 1) / 10 if step < 10 else 1e-6 + (1e-3 - 1e-6) * 0.5 * (
            1 + math.cos(math.pi * min((step - 10) / 100, 1.0)))
        assert lr_at(step, args, 110) == expected


def test_a_wsd_decay_longer_than_the_run_is_one_line():
    from lingua.train import TrainArgs
    with pytest.raises(UserError, match="optim.decay_steps.*exceed the run's 30 steps"):
        TrainArgs(dump_dir="d", steps=30, optim=OptimArgs(warmup=10, schedule="wsd", decay_steps=25))
    with pytest.raises(UserError, match="schedule"):
        OptimArgs(schedule="step")
