"""The app contract: what an app gives the shared training loop (lingua/train.py), and nothing more.

An app is a folder `apps/<name>/` with
- `model.py`: its model args (a dataclass, validated in `__post_init__`), its model (a plain `nn.Module` following
  `EncoderModel` below) and `build_<name>(args, tokenizer)`;
- `train.py`: `<Name>TrainArgs(TrainArgs)` adding `model: <Name>Args`, and a module-level `APP = App(...)` (checkpoints
  store the module's name and rebuild the model through it), then `main(APP)`;
- `configs/*.yaml`.
An app that trains on something other than packed text rows (e.g. contrastive triplets) gives its own `DataPipeline`;
one that starts from another app's weights gives `load_init` (and `configure`, to take that run's shapes).
The model args hold the backbone as `encoder: TransformerArgs` (the loop reads `encoder.max_seqlen`; resuming compares
the architecture fields of every `TransformerArgs` under `model`). The loop builds the model on the meta device, parallelises it, materialises it and calls `init_weights`; it owns
the data, the optimizer, the schedule, checkpoints, logging and the random generator; the model owns its masking,
its loss, its FLOPs and its shape. No app imports another: what several apps share lives in `lingua/` (for
example `lingua/masking.py`).
"""

import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol

import torch
from torch import nn

from lingua.args import UserError, load_config
from lingua.data import build_train_loader, load_validation, repartition
from lingua.distributed import DistributedArgs, Launch
from lingua.parallel import parallelize


class EncoderModel(Protocol):
    views_per_sequence: int
    """Token-views per data sequence in one step (1; CrossBERT with CMS: 2), for throughput and compute."""

    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The inputs of `forward` for a batch of token rows [B, S]. Every random draw of a step is made here, from
        `generator` (the loop's, checkpointed: a resumed run draws the same); randomness that `forward` needs
        (e.g. uniforms for sampling) travels in the batch, so `forward` stays deterministic and compilable. Every
        tensor has the batch first (validation splits rows over ranks) and a shape that does not depend on the
        draw."""

    def forward(self, **batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, stats): the scalar loss to minimise and scalar tensors the loop logs as means over the logging
        window and the ranks (e.g. accuracy, each term of a composite loss). No host sync, no random draw."""

    def predicted_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens predicted in this batch, from shapes only (no sync): logged as predicted_tokens_per_s."""

    @property
    def backbone(self) -> nn.Module:
        """The `lingua.transformer.Encoder` whose states `encode` returns: what embeddings, contrastive training and
        fine-tuning start from."""

    def encode(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None, all_layers: bool = False):
        """The frozen representation for evaluation: the full, unmasked sequence [B, S] -> hidden states [B, S, D]
        after the final norm (padding, pad_mask False, hidden), or every layer's output with all_layers."""

    def flops_per_token_view(self, seq_len: int) -> float:
        """Training FLOPs per token-view (forward and backward), as the paper counts them (eq. 7-8): the compute C."""

    def head_flops_per_token_view(self, seq_len: int) -> float:
        """The FLOPs per token-view of the output heads that `flops_per_token_view` leaves out (the paper's
        convention); the sum of both is what a step runs, and what MFU counts."""

    def sharding_units(self) -> list[nn.Module]:
        """The modules FSDP shards, compiles and checkpoints one by one (the transformer blocks); the rest (the
        embedding and tied head) stays with the root."""

    def init_weights(self) -> None:
        """Fills every parameter and buffer after materialisation from the meta device (under torch.no_grad)."""


@dataclass(frozen=True)
class DataPipeline:
    """Where an app's batches come from. Each batch is a LongTensor with the batch first (it goes to `make_batch`);
    every function takes the config's `data` section."""

    build_loader: Callable  # (data args, tokenizer, rank, world_size, state or None) -> endless iterator of batches
    # with state_dict() (plain JSON: where the next batch starts), malformed_lines, close() and the context protocol
    load_validation: Callable  # (data args, tokenizer, n_rows) -> fixed validation rows, the batch first
    repartition: Callable  # (states saved by N ranks, world_size, data args) -> one state per new rank
    row_shape: Callable  # (data args) -> the shape of one row of a batch, e.g. (seq_len,)


TEXT = DataPipeline(build_train_loader, load_validation, repartition, lambda args: (args.seq_len,))


@dataclass
class App:
    name: str  # the module that defines APP, e.g. "apps.bert.train"; stored with checkpoints to rebuild the model
    args_cls: type  # a TrainArgs subclass with a `model` field
    build_model: Callable[[Any, Any], EncoderModel]  # (model args, tokenizer) -> model, called on the meta device
    data: DataPipeline = TEXT  # packed rows of the text corpus (lingua/data.py)
    configure: Callable[[Any], Any] | None = None  # the config adjusted before the run (e.g. from init_from)
    load_init: Callable[[Any, Any], dict] | None = None  # (init_from's Checkpoint, model) -> the config it was
    # trained with; default: the checkpoint's weights into the model as it is (Checkpoint.load_into)

    @property
    def model_args_cls(self) -> type:
        """The dataclass of the `model` section of the app's config."""
        return typing.get_type_hints(self.args_cls)["model"]


def load_app(name: str) -> App:
    """The App of apps/<name>/train.py."""
    try:
        return import_module(f"apps.{name}.train").APP
    except ModuleNotFoundError:
        raise UserError(f"unknown app '{name}' (an app is a folder apps/<name>/ with a train.py)") from None


def app_variant(label: str, base: dict[str, Any]) -> tuple[App, Any]:
    """`name` or `name+key=value+...` (e.g. `crossbert+cms=false`): the app and its model args, from `base` (a
    nested dict of model fields) and then the label's overrides."""
    name, *overrides = label.split("+")
    app = load_app(name.strip())
    return app, load_config(app.model_args_cls, overrides, base=base)


def build_model(build_fn, model_args, tokenizer, device: torch.device, seed: int = 0,
                parallel: tuple[DistributedArgs, Launch] | None = None) -> nn.Module:
    """The one way models are built, for training and for loading: on the meta device (no memory), parallelised
    when asked (`parallel`), materialised on `device`, then initialised from `seed` (`init_weights`)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_fn(model_args, tokenizer)
    if parallel is not None:
        parallelize(model, model.sharding_units(), *parallel, device)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model
