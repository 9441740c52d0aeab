"""How a model runs on its devices: mixed precision, and the parallelism plan (activation checkpointing and
`torch.compile` per block, FSDP2 per block and at the root), applied on the meta device before the weights exist.

On CPU the precision is fp32; on GPUs, bf16 compute with gradients reduced in fp32 (or bf16: reduce_dtype).
`fsdp_type: auto` chooses the sharding from the model's size, a device's memory and the ranks (`choose_sharding`).
"""

import contextlib
import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lingua.distributed import DistributedArgs, Launch, broadcast_object
from lingua.errors import UserError

logger = logging.getLogger(__name__)

STATE_BYTES = 16  # per parameter: fp32 weight, its gradient, AdamW's two moments
STATE_SHARE = 0.5  # of a device's memory at most for them under `auto`: the rest is the activations'
GIB = 2**30


@dataclass(frozen=True)
class Sharding:
    """An FSDP plan: its type, the ranks each parameter is sharded over (1: replicated), and why it was chosen."""

    fsdp_type: str
    shard_size: int
    reason: str


def choose_sharding(n_params: int, bytes_per_param: int, device_memory: int, world_size: int,
                    local_world_size: int) -> Sharding:
    """The plan whose collectives cost least, among those where each device keeps the weights, gradients and
    optimizer state within STATE_SHARE of its memory (docs/training.md: the arithmetic). On one node: replicated when
    one device holds them (a gradient all-reduce a step, no all-gather before each block), else sharded over the
    node. Over several nodes: sharded within each node and replicated across them when a node holds them (the
    all-gathers stay on the node's links and only a shard's gradients cross nodes, 1/node of the traffic), else
    sharded over all ranks."""
    state, budget = n_params * bytes_per_param, device_memory * STATE_SHARE
    node, nodes = local_world_size, world_size // local_world_size
    what = (f"{n_params / 1e6:,.1f}M parameters x {bytes_per_param} bytes = {state / GIB:,.1f} GiB of weights, "
            f"gradients and optimizer state, against {STATE_SHARE:.0%} of a device's {device_memory / GIB:,.1f} GiB")
    if world_size == 1:
        return Sharding("no_shard", 1, "one process")
    if state <= budget and (nodes == 1 or node == 1):
        return Sharding("no_shard", 1, f"{what}: one device holds them")
    if nodes > 1 and node > 1 and world_size % node == 0 and state / node <= budget:
        return Sharding("hybrid_shard", node, f"{what}: a node's {node} devices hold them, so only a shard's "
                                              f"gradients cross the {nodes} nodes")
    return Sharding("full_shard", world_size, f"{what}: only all {world_size} ranks together hold them")


def device_memory(device: torch.device, local_world_size: int) -> int:
    """Bytes of one device: a GPU's whole memory, or the host's shared by this node's processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_world_size


def configured_sharding(args: DistributedArgs, n_params: int, launch: Launch, device: torch.device) -> Sharding:
    """The plan `args` asks for: the configured type, or `auto`'s choice from this rank's view of the sizes."""
    world = launch.world_size
    if args.fsdp_type == "auto":
        return choose_sharding(n_params, STATE_BYTES, device_memory(device, launch.local_world_size), world,
                               launch.local_world_size)
    shard = {"full_shard": world, "no_shard": 1}.get(args.fsdp_type, args.shard_size or launch.local_world_size)
    return Sharding(args.fsdp_type, shard, "set by distributed.fsdp_type")


def sharding_plan(args: DistributedArgs, n_params: int, launch: Launch, device: torch.device) -> Sharding:
    """`configured_sharding`, with `auto` rank 0's choice on every rank (they build the same mesh)."""
    plan = configured_sharding(args, n_params, launch, device)
    return broadcast_object(plan) if args.fsdp_type == "auto" else plan


def precision_policy(reduce_dtype: str, mixed_precision: bool):
    """FSDP2's precision: parameters gathered in bf16 and gradients reduced in `reduce_dtype` under mixed precision,
    fp32 throughout without it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not mixed_precision:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.bfloat16 if reduce_dtype == "bf16" else torch.float32)


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
    bf16 and reduces gradients in `args.reduce_dtype`."""
    for block in blocks:
        if args.activation_checkpointing != "none":
            _checkpoint_activations(block, args.activation_checkpointing)
        if args.compile:
            block.compile(fullgraph=True, backend=args.compile_backend)
    if dist.is_initialized():  # several processes, or torchrun's one
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        plan = sharding_plan(args, sum(p.numel() for p in model.parameters()), launch, device)
        logger.info(f"FSDP {plan.fsdp_type}, each parameter sharded over {plan.shard_size} of "
                    f"{launch.world_size} rank(s): {plan.reason}")
        mesh = _device_mesh(plan, launch, device)
        if mixed_precision is None:
            mixed_precision = device.type == "cuda"
        if args.reduce_dtype == "bf16" and not mixed_precision:
            logger.warning("distributed.reduce_dtype=bf16 takes effect under mixed precision only (GPUs): "
                           "gradients are reduced in fp32")
        policy = precision_policy(args.reduce_dtype, mixed_precision)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for method in getattr(model, "evaluation_methods", ("encode",)):  # called outside forward: gather there too
            register_fsdp_forward_method(model, method)
    return model


def _device_mesh(plan: Sharding, launch: Launch, device: torch.device):
    """1-D mesh for full_shard; (replicate, shard) 2-D mesh for no_shard (shard 1) and hybrid_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    world, shard = launch.world_size, plan.shard_size
    if plan.fsdp_type == "full_shard":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
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
