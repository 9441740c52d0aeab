"""Every app's training step (masking outside, forward and loss, backward) traces as one graph (fullgraph=True: a
graph break raises) and is not recompiled across steps with new random batches (torch's compile counters)."""

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from apps import registered_apps
from lingua.app import TEXT, build_model, load_app
from lingua.args import load_config
from lingua.model.transformer import PreNormBlock

VOCAB = 64
TINY = ["encoder.dim=32", "encoder.n_layers=2", "encoder.n_heads=4", "encoder.max_seqlen=32", "encoder.head_chunk=16"]
# Every registered app that trains on text rows, with its defaults and each of its variants.
APPS = {f"{app.short_name}{', ' + variant if variant else ''}": overrides
        for app in registered_apps() if app.data is TEXT for variant, overrides in {"": [], **app.variants}.items()}


@pytest.mark.parametrize("variant", APPS)
def test_training_step_compiles_as_one_graph_and_never_recompiles(variant):
    app = load_app(variant.split(",")[0])
    model_args = load_config(app.model_args_cls, TINY + APPS[variant])
    model = build_model(app.build_model, model_args, SimpleNamespace(vocab_size=VOCAB, mask_id=VOCAB - 1),
                        torch.device("cpu"))
    torch._dynamo.reset()
    # Dynamo and AOT autograd, without Inductor's code generation: Inductor compiles what training compiles (each
    # block, distributed.compile=true) in the GPU acceptance's dry run, tests/test_gpu_acceptance.py
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = model.make_batch(torch.randint(0, VOCAB - 4, (2, 24), generator=generator), generator)
        loss, stats = compiled(**batch)
        loss.backward()
        if step == 0:
            eager_loss, _ = model(**batch)
            assert torch.allclose(loss, eager_loss, atol=1e-5)
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times in 3 steps"
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation exists on GPUs only")
@pytest.mark.parametrize("variant", APPS)
def test_training_step_does_not_synchronise_with_the_host(variant):
    from tools.benchmark import BenchmarkArgs, build, step

    args = BenchmarkArgs(apps=variant.split(",")[0], batch_size=2, seq_len=24, vocab_size=VOCAB, warmup=1,
                         encoder=load_config(load_app("bert").model_args_cls, TINY).encoder)
    contender = build(args.apps, args, torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        step(contender, args, torch.device("cuda"), synchronise=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_blocks_name_their_attention_and_mlp_to_the_profiler():
    """The profile of an eager step splits it by these ranges; compiled, they are left out (the test above traces
    the blocks that hold them as one graph)."""
    from torch.profiler import profile

    app = load_app("crossbert")  # self-attention blocks in the encoder, cross-attention blocks in the predictor
    model = build_model(app.build_model, load_config(app.model_args_cls, TINY),
                        SimpleNamespace(vocab_size=VOCAB, mask_id=VOCAB - 1), torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    batch = model.make_batch(torch.randint(0, VOCAB - 4, (2, 24), generator=generator), generator)
    n_blocks = sum(isinstance(module, PreNormBlock) for module in model.modules())
    with profile() as prof:
        model(**batch)
    names = [event.name for event in prof.events()]
    assert names.count("attention") == names.count("mlp") == n_blocks > 2  # the encoder's and the predictor's
