"""The shared masking: every app's mask ratio checked at config time, and the masked-LM loss (the chunked output head
against the plain logits + cross-entropy, the compiled chunks against the eager ones)."""

import dataclasses
import typing

import pytest
import torch
import torch.nn.functional as F

from apps import registered_apps
from lingua.args import load_config
from lingua.errors import UserError
from lingua.model.masking import chunked_lm_loss, head_loss_path, masked_lm_loss
from lingua.model.transformer import TransformerArgs

N, D, V = 37, 16, 29
MASKING_APPS = [app for app in registered_apps()
                if "mask_ratio" in {f.name for f in dataclasses.fields(typing.get_type_hints(app.args_cls)["model"])}]


def test_the_masking_apps_are_found():
    assert {app.short_name for app in MASKING_APPS} >= {"bert", "crossbert", "electra"}


@pytest.mark.parametrize("ratio", ["0", "1", "-0.5", "1.5"])
@pytest.mark.parametrize("app", MASKING_APPS, ids=lambda app: app.short_name)
def test_a_mask_ratio_outside_0_1_is_refused_in_one_line_at_config_time(app, ratio):
    with pytest.raises(UserError) as refused:
        load_config(app.args_cls, ["dump_dir=unused", f"model.mask_ratio={ratio}"])
    assert str(refused.value) == f"config key 'model.mask_ratio' must be strictly between 0 and 1, got {float(ratio)}"


def inputs(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, N, D, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=generator, dtype=dtype).requires_grad_()
    return hidden, weight, torch.randint(0, V, (3, N), generator=generator)


def loss_and_grads(loss_fn, with_bias: bool):
    hidden, weight, targets = inputs()
    bias = torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=weight.dtype).requires_grad_()
    loss, stats = loss_fn(hidden, weight, targets, bias if with_bias else None)
    (3 * loss).backward()  # a scale on the loss reaches every gradient
    return loss, stats["accuracy"], hidden.grad, weight.grad, bias.grad if with_bias else torch.zeros(())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 10, 37, 111, 4096])
def test_chunked_head_equals_the_whole_logits(chunk, with_bias):
    expected = loss_and_grads(lambda h, w, t, b: masked_lm_loss(F.linear(h, w, b), t), with_bias)
    got = loss_and_grads(lambda h, w, t, b: chunked_lm_loss(h, w, t, chunk, b), with_bias)
    for name, a, b in zip(("loss", "accuracy", "grad hidden", "grad weight", "grad bias"), got, expected):
        assert torch.allclose(a, b.to(a.dtype), rtol=1e-10, atol=1e-7), name  # accuracy: fp32 in the reference


def test_chunked_head_without_grad_computes_no_gradient():
    hidden, weight, targets = inputs(torch.float32)
    with torch.no_grad():
        loss, stats = chunked_lm_loss(hidden, weight, targets, 8)
    assert loss.grad_fn is None and not stats["accuracy"].requires_grad
    assert torch.allclose(loss, masked_lm_loss(hidden @ weight.t(), targets)[0], atol=1e-5)


def test_chunked_head_in_bf16_sums_in_fp32():
    hidden, weight, targets = inputs(torch.float32)
    loss, stats = chunked_lm_loss(hidden.bfloat16(), weight.bfloat16(), targets, 8)
    loss.backward()
    assert not stats["accuracy"].requires_grad
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert torch.allclose(loss, masked_lm_loss(hidden @ weight.t(), targets)[0], rtol=2e-2)


@pytest.fixture
def fresh_compile():
    """Each test's graphs counted alone: the chunk's compiled graphs of earlier tests would fill Dynamo's cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def bf16_close(got, expected, dtype):
    if dtype == torch.float32:
        return torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    return (got.float() - expected.float()).norm() <= 2e-2 * expected.float().norm() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [37, 10])  # 111 rows: 3 whole chunks; 11 chunks, the last one shorter
def test_the_compiled_head_equals_the_eager_reference(fresh_compile, chunk, dtype):
    """aot_eager here (Dynamo's trace and AOT's graphs, in seconds); Inductor's code is checked once, below."""
    def run(head_loss):
        return loss_and_grads(lambda h, w, t, b: chunked_lm_loss(h.to(dtype), w.to(dtype), t, chunk, b.to(dtype),
                                                                 head_loss, "aot_eager"), with_bias=True)
    eager, compiled = run("eager"), run("compiled")
    for name, a, b in zip(("loss", "accuracy", "grad hidden", "grad weight", "grad bias"), compiled, eager):
        assert bf16_close(a, b, dtype), name


def test_the_head_compiled_by_inductor_equals_eager_in_bf16_and_compiles_once_per_shape(fresh_compile):
    hidden, weight, targets = (t.detach() for t in inputs(torch.float32))
    results = []
    for head_loss, calls in (("eager", 1), ("compiled", 2)):  # the second compiled call may not recompile
        for call in range(calls):
            with torch.compiler.set_stance("fail_on_recompile" if call else "default"):
                h, w = (t.bfloat16().requires_grad_() for t in (hidden, weight))
                loss, stats = chunked_lm_loss(h, w, targets, 10, None, head_loss)
                loss.backward()
        results.append((loss, stats["accuracy"], h.grad, w.grad))
    for name, a, b in zip(("loss", "accuracy", "grad hidden", "grad weight"), *results):
        assert bf16_close(a, b, torch.bfloat16), name


def test_the_compiled_head_traces_into_a_compiled_step_as_one_graph(fresh_compile):
    """On a GPU, auto takes the compiled chunks, which a step compiled whole (fullgraph) must inline."""
    hidden, weight, targets = inputs(torch.float32)
    compiled_step = torch.compile(lambda h, w, t: chunked_lm_loss(h, w, t, 10, None, "compiled", "aot_eager"),
                                  fullgraph=True, backend="aot_eager")
    loss, _ = compiled_step(hidden, weight, targets)
    assert torch.allclose(loss, chunked_lm_loss(hidden, weight, targets, 10)[0])


def test_auto_picks_eager_on_a_cpu_compiled_on_a_gpu_and_liger_needs_its_kernel_on_cuda():
    assert head_loss_path("auto", torch.device("cpu")) == "eager"
    assert head_loss_path("auto", torch.device("cuda")) == "compiled"  # Liger only when asked for
    assert head_loss_path("compiled", torch.device("cpu")) == "compiled"
    with pytest.raises(UserError, match="liger_kernel"):
        head_loss_path("liger", torch.device("cpu"))
    with pytest.raises(UserError, match="config key 'head_loss' must be one of auto, eager, compiled, liger"):
        TransformerArgs(head_loss="fused")
