"""The GPU code paths, exercised on the CPU first, so that the dtype and device errors a GPU would show are caught
by CI: every app's training step under bf16 autocast, forward and backward on the meta device (a tensor that the
step made on the CPU would not mix with it), the chunked head's gradients in bf16; on a GPU, the attention
backends agreeing in bf16."""

from types import SimpleNamespace

import pytest
import torch

from apps import registered_apps
from lingua.app import TEXT, build_model, load_app
from lingua.args import load_config
from lingua.model.masking import chunked_lm_loss, masked_lm_loss
from lingua.model.transformer import Segments, attention, build_attn_bias, padding_mask
from lingua.training.optim import OptimArgs, build_optimizer
from lingua.training.step import training_step

VOCAB = 64
TINY = ["encoder.dim=32", "encoder.n_layers=2", "encoder.n_heads=4", "encoder.max_seqlen=32", "encoder.head_chunk=16"]
APPS = {f"{app.short_name}{', ' + variant if variant else ''}": overrides
        for app in registered_apps() if app.data is TEXT for variant, overrides in {"": [], **app.variants}.items()}


def tiny_model(variant: str):
    app = load_app(variant.split(",")[0])
    model_args = load_config(app.model_args_cls, TINY + APPS[variant])
    tokenizer = SimpleNamespace(vocab_size=VOCAB, mask_id=VOCAB - 1)
    return build_model(app.build_model, model_args, tokenizer, torch.device("cpu"), seed=0)


def batch_for(model):
    generator = torch.Generator().manual_seed(0)
    return model.make_batch(torch.randint(0, VOCAB - 4, (2, 24), generator=generator), generator)


@pytest.mark.parametrize("variant", APPS)
def test_a_step_under_bf16_autocast_matches_fp32(variant):
    results = []
    for precision in (None, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        model = tiny_model(variant)
        results.append(training_step(model, build_optimizer(model, OptimArgs()), [batch_for(model)], 1.0, precision))
    fp32, bf16 = results
    assert bf16.loss.dtype == torch.float32 and torch.isfinite(bf16.grad_norm)
    assert bf16.loss.item() == pytest.approx(fp32.loss.item(), rel=2e-2)
    assert bf16.grad_norm.item() == pytest.approx(fp32.grad_norm.item(), rel=0.1)


@pytest.mark.parametrize("variant", APPS)
def test_forward_and_backward_make_no_tensor_on_another_device(variant):
    """On the meta device, any tensor the step creates without the inputs' device (on the CPU) raises on first use."""
    model = tiny_model(variant)
    batch = {key: value.to("meta") for key, value in batch_for(model).items()}
    loss, stats = model.to("meta")(**batch)
    loss.backward()
    assert loss.device.type == "meta" and all(value.device.type == "meta" for value in stats.values())
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)


def test_the_chunked_head_in_bf16_gives_the_gradients_of_fp32():
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 32, 32, generator=generator), torch.randn(50, 32, generator=generator) / 4
    targets = torch.randint(0, 50, (2, 32), generator=generator)
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        h, w = (t.to(dtype, copy=True).requires_grad_() for t in (hidden, weight))
        loss, _ = chunked_lm_loss(h, w, targets, 16)
        loss.backward()
        grads.append((loss.item(), h.grad.float(), w.grad.float()))
    reference = masked_lm_loss(hidden @ weight.t(), targets)[0]
    (loss32, h32, w32), (loss16, h16, w16) = grads
    assert loss32 == pytest.approx(reference.item(), rel=1e-5) and loss16 == pytest.approx(reference.item(), rel=2e-2)
    for got, expected in ((h16, h32), (w16, w32)):
        assert (got - expected).norm() / expected.norm() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash and flex kernels exist on GPUs only")
@pytest.mark.parametrize("layout", ["none", "padding", "segments"])
def test_attention_backends_agree_in_bf16(layout):
    """sdpa (flash or memory-efficient kernels) and flex attention against fp32 math, in bf16 on the GPU."""
    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", generator=generator) for _ in range(3))
    real = torch.ones(2, 128, dtype=torch.bool, device="cuda")
    real[1, 100:] = False  # the second row is padded
    mask = {"none": None, "padding": padding_mask(real), "segments": Segments((48, 80), (48, 80))}[layout]
    reference = attention(q, k, v, build_attn_bias(mask, "sdpa", 4), "sdpa")  # fp32
    for backend in ("sdpa", "flex"):
        got = attention(*(t.bfloat16() for t in (q, k, v)), build_attn_bias(mask, backend, 4), backend)
        assert got.dtype == torch.bfloat16 and (got.float() - reference).abs().max() < 2e-2, backend


@pytest.mark.parametrize("backend, expected", [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu"))])
def test_the_library_own_collectives_put_their_tensors_where_the_backend_wants_them(monkeypatch, backend, expected):
    """nccl takes GPU tensors only: the agreement's flags and a rank's failure travel on this rank's GPU there."""
    from lingua import distributed

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.collective_device() == expected
