"""How a model runs on its devices: mixed precision, and the parallelism plan (activation checkpointing and
`torch.compile` per block, FSDP2 per block and at the root), applied on the meta device before the weights exist.

On CPU the precision is fp32; on GPUs, bf16 compute with fp32 gradient reduction.
"""

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from lingua.distributed import DistributedArgs, Launch
from lingua.errors import UserError


def autocast(device: torch.device):
    """bf16 mixed precision on GPU; full precision on CPU, where bf16 matmuls are slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def parallelize(model: nn.Module, blocks: list[nn.Module], args: DistributedArgs, launch: Launch,
                device: torch.device, mixed_precision: bool | None = None) -> nn.Module:
    """Activation checkpointing and compile per block, then FSDP2 per block and at the root (which keeps the
    embedding, the tied head and everything outside the blocks). Applied on the meta device, before the weights
    are materialised; parameter names are unchanged. `mixed_precision` (default: on GPUs) gathers parameters in
    bf16 and reduces gradients in fp32."""
    for block in blocks:
        if args.activation_checkpointing != "none":
            _checkpoint_activations(block, args.activation_checkpointing)
        if args.compile:
            block.compile(fullgraph=True, backend=args.compile_backend)
    if dist.is_initialized():  # several processes, or torchrun's one
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mesh = _device_mesh(args, launch, device)
        if mixed_precision is None:
            mixed_precision = device.type == "cuda"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed_precision else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for method in getattr(model, "evaluation_methods", ("encode",)):  # called outside forward: gather there too
            register_fsdp_forward_method(model, method)
    return model


def _device_mesh(args: DistributedArgs, launch: Launch, device: torch.device):
    """1-D mesh for full_shard; (replicate, shard) 2-D mesh for no_shard (shard 1) and hybrid_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    world = launch.world_size
    if args.fsdp_type == "full_shard":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    shard = 1 if args.fsdp_type == "no_shard" else (args.shard_size or launch.local_world_size)
    if world % shard:
        raise UserError(f"distributed.shard_size {shard} does not divide the {world} processes")
    return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def _checkpoint_activations(block: nn.Module, mode: str) -> None:
    """full: keep only the block's inputs and recompute the rest in the backward pass. selective: keep the outputs
    of matmuls and attention too, recomputing only cheap element-wise ops (norms, SwiGLU's gate, RoPE). The block's
    forward is wrapped in place, so parameter names do not change and the block still compiles."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    forward = block.forward
    if mode == "full":
        block.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, policy)  # a partial: compile traces it
        block.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False, context_fn=context)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Gradient accumulation: FSDP reduces gradients only on the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
