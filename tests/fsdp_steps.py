"""A few optimizer steps of a tiny model through the library's build path and step pieces, on fixed global batches
whose rows and masks do not depend on the number of processes: each rank takes its rows of every global batch.

    python tests/fsdp_steps.py OUT.json CONFIGURATION [CONFIGURATION ...]
    torchrun --nproc-per-node 2 tests/fsdp_steps.py OUT.json CONFIGURATION [CONFIGURATION ...]

A CONFIGURATION is one argument of space-separated settings, each optional: "app=bert fsdp_type=full_shard ac=none
compile=false backend=inductor grad_acc=1 bf16=false ema=0". One launch runs them one after the other, each model
built afresh (starting the processes costs more than the steps). Rank 0 writes {configuration: per step, the loss
(mean over all rows) and the gradient norm; with ema=DECAY, the loss of the weights' average on the step's rows too,
swapped in after the step}. Used by tests/test_distributed.py.
"""

import json
import sys
from dataclasses import replace

import torch

from apps.bert.train import APP as BERT
from apps.crossbert.train import APP as CROSSBERT
from lingua.app import build_model
from lingua.args import load_config
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.distributed import DistributedArgs, all_reduce, destroy_process_group, detect_launch, init_process_group
from lingua.parallel import parallelize
from lingua.training.ema import WeightsAverage
from lingua.training.optim import OptimArgs, build_optimizer
from lingua.training.step import training_step

GLOBAL_ROWS, SEQ_LEN, STEPS = 8, 32, 4


def steps(launch, device, app: str = "bert", fsdp_type: str = "full_shard", ac: str = "none", compile: str = "false",
          backend: str = "inductor", grad_acc: str = "1", bf16: str = "false", ema: str = "0") -> list[dict]:
    app = {"bert": BERT, "crossbert": CROSSBERT}[app]
    model_args = load_config(app.args_cls, ["dump_dir=x", "model.encoder.dim=32", "model.encoder.n_layers=2",
                                            "model.encoder.n_heads=2", "model.encoder.max_seqlen=32"]).model
    parallel = replace(DistributedArgs(), fsdp_type=fsdp_type, activation_checkpointing=ac,
                       compile=compile == "true", compile_backend=backend)
    tokenizer = build_tokenizer(TokenizerArgs(name="bytes"))
    def plan(model, args, launch, device):  # FSDP2's bf16 policy (the GPUs') when asked, on the CPU
        parallelize(model, model.sharding_units(), args, launch, device, mixed_precision=bf16 == "true")

    model = build_model(app.build_model, model_args, tokenizer, device, seed=0, parallel=(parallel, launch), plan=plan)
    optimizer = build_optimizer(model, OptimArgs(lr=3e-3, warmup=0))
    average = WeightsAverage(model, float(ema)) if float(ema) else None
    data, masks = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    records = []
    for _ in range(STEPS):
        batches = []
        for _ in range(int(grad_acc)):
            tokens = torch.randint(0, 256, (GLOBAL_ROWS, SEQ_LEN), generator=data)
            batch = model.make_batch(tokens, masks)  # the global batch's masks, the same on every rank
            batches.append({key: value.tensor_split(launch.world_size)[launch.rank] for key, value in batch.items()})
        result = training_step(model, optimizer, batches, clip=1.0)
        records.append({"loss": (all_reduce(result.loss) / launch.world_size).item(),
                        "grad_norm": result.grad_norm.item()})
        if average is not None:
            average.update()
            with average.swapped_in(), torch.no_grad():
                loss = sum(model(**batch)[0] for batch in batches) / len(batches)
            records[-1]["ema_loss"] = (all_reduce(loss) / launch.world_size).item()
    return records


def main(out: str, *configurations: str) -> None:
    launch = detect_launch()
    device = torch.device("cpu")
    init_process_group(launch, device, timeout_minutes=5)
    results = {configuration: steps(launch, device, **dict(setting.split("=", 1) for setting in configuration.split()))
               for configuration in configurations}
    if launch.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
