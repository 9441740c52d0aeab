"""Sharding that follows scale: `distributed.fsdp_type=auto` as a function of the model's size, a device's memory
and the ranks; bf16 gradient reduction; their config keys."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from apps.bert.model import Bert, BertArgs
from apps.bert.train import APP
from lingua.args import load_config
from lingua.distributed import DistributedArgs, Launch
from lingua.errors import UserError
from lingua.model.transformer import TransformerArgs
from lingua.parallel import STATE_BYTES, choose_sharding, parallelize, precision_policy, sharding_plan

GIB = 2**30
CROSSBERT = 279_300_000  # the single-scale CrossBERT, embedding included: 4.2 GiB with its gradients and AdamW


def plan(n_params, world, local, memory=80 * GIB) -> tuple[str, int]:
    chosen = choose_sharding(n_params, STATE_BYTES, memory, world, local)
    return chosen.fsdp_type, chosen.shard_size


def test_the_paper_models_are_replicated_on_a_node_and_sharded_within_nodes_across_them():
    assert plan(CROSSBERT, world=8, local=8) == ("no_shard", 1)
    assert plan(CROSSBERT, world=64, local=8) == ("hybrid_shard", 8)  # only an eighth of the gradients cross nodes
    assert plan(CROSSBERT, world=4, local=1) == ("no_shard", 1)  # one device per node: nothing to shard within


def test_a_model_is_sharded_over_as_few_ranks_as_hold_it():
    # a device keeps half its memory for activations: 40 GiB of 80 for the 16 bytes a parameter
    two_billion, six_billion, thirty_billion = 2_000_000_000, 6_000_000_000, 30_000_000_000  # 30, 89, 447 GiB
    assert plan(two_billion, world=8, local=8) == ("no_shard", 1)
    assert plan(six_billion, world=8, local=8) == ("full_shard", 8)  # one node: sharding over it is all there is
    assert plan(six_billion, world=64, local=8) == ("hybrid_shard", 8)  # 11 GiB a device within a node
    assert plan(thirty_billion, world=64, local=8) == ("full_shard", 64)  # 56 GiB a device within a node, 7 over 64
    assert plan(six_billion, world=4, local=1) == ("full_shard", 4)


def test_the_budget_is_half_a_device_inclusive_and_one_process_never_shards():
    at_budget = 40 * GIB // STATE_BYTES
    assert plan(at_budget, world=8, local=8) == ("no_shard", 1)
    assert plan(at_budget + 1, world=8, local=8) == ("full_shard", 8)
    assert plan(10 * at_budget, world=1, local=1) == ("no_shard", 1)
    assert plan(at_budget + 1, world=16, local=8, memory=160 * GIB) == ("hybrid_shard", 8)  # the device's memory
    reason = choose_sharding(CROSSBERT, STATE_BYTES, 80 * GIB, 64, 8).reason
    assert "279.3M parameters x 16 bytes = 4.2 GiB" in reason and "a node's 8 devices hold them" in reason


def test_a_configured_plan_is_kept():
    launch = Launch(world_size=8, local_world_size=4)
    cpu = torch.device("cpu")
    shards = {fsdp_type: sharding_plan(DistributedArgs(fsdp_type=fsdp_type), 10**12, launch, cpu).shard_size
              for fsdp_type in ("full_shard", "no_shard", "hybrid_shard")}
    assert shards == {"full_shard": 8, "no_shard": 1, "hybrid_shard": 4}
    assert sharding_plan(DistributedArgs(fsdp_type="hybrid_shard", shard_size=2), 1, launch, cpu).shard_size == 2


def test_config_keys_and_their_one_line_errors():
    config = load_config(APP.args_cls, ["dump_dir=run", "distributed.fsdp_type=auto",
                                              "distributed.reduce_dtype=bf16"])
    assert (config.distributed.fsdp_type, config.distributed.reduce_dtype) == ("auto", "bf16")
    assert load_config(APP.args_cls, ["dump_dir=run"]).distributed.reduce_dtype == "fp32"
    with pytest.raises(UserError, match="^config key 'distributed.reduce_dtype' must be one of fp32, bf16$"):
        load_config(APP.args_cls, ["dump_dir=run", "distributed.reduce_dtype=fp16"])
    with pytest.raises(UserError, match="^config key 'distributed.fsdp_type' must be one of .*, auto$"):
        load_config(APP.args_cls, ["dump_dir=run", "distributed.fsdp_type=ddp"])


def test_gradients_are_reduced_in_bf16_only_when_asked_and_under_mixed_precision():
    assert precision_policy("bf16", True).reduce_dtype == torch.bfloat16
    assert precision_policy("fp32", True).reduce_dtype == torch.float32
    assert precision_policy("fp32", True).param_dtype == torch.bfloat16
    assert precision_policy("bf16", False).reduce_dtype is None  # fp32 throughout


def test_auto_builds_the_chosen_mesh_and_says_why_in_one_line(caplog):
    """One process under a process group (as torchrun's one): a tiny BERT is replicated, on a 2-D mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = Bert(BertArgs(encoder=TransformerArgs(dim=8, n_layers=1, n_heads=2, ffn_multiple_of=8)), 50, 49)
        args = DistributedArgs(fsdp_type="auto", reduce_dtype="bf16")
        with caplog.at_level(logging.INFO, logger="lingua.parallel"):
            parallelize(model, model.sharding_units(), args, Launch(), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    lines = [r.getMessage() for r in caplog.records if r.name == "lingua.parallel"]
    assert lines[0] == "FSDP no_shard, each parameter sharded over 1 of 1 rank(s): one process"
    assert "reduce_dtype=bf16 takes effect under mixed precision only" in lines[1]  # a CPU: fp32
    assert model.encoder.tok_embeddings.weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")


def test_the_memory_check_counts_the_weights_over_the_ranks_the_plan_shards_them_over():
    """The start-up estimate (lingua/training/memory.py) divides weights and AdamW state by the plan's shard size:
    `auto`'s choice, not every rank."""
    from lingua.model.flops import count_params
    from lingua.training.memory import estimate

    node = Launch(world_size=8, local_world_size=8)
    weights = {}
    for fsdp_type in ("auto", "full_shard", "no_shard", "hybrid_shard"):
        config = load_config(APP.args_cls, ["dump_dir=x", "model.encoder.dim=32", "model.encoder.n_layers=1",
                                            "model.encoder.n_heads=2", "data.tokenizer.name=bytes",
                                            f"distributed.fsdp_type={fsdp_type}", "distributed.shard_size=4"])
        weights[fsdp_type] = estimate(APP, config, node, torch.device("cpu"))["weights and optimizer"]
    with torch.device("meta"):
        n_params = count_params(APP.build_model(config.model, SimpleNamespace(vocab_size=260, mask_id=259)))
    assert weights["auto"] == weights["no_shard"] == STATE_BYTES * n_params  # a tiny model: replicated
    assert weights["full_shard"] == STATE_BYTES * n_params // 8
    assert weights["hybrid_shard"] == STATE_BYTES * n_params // 4
