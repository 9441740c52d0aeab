"""The app contract: what an app gives the shared training loop (lingua/train.py) and the tools, and nothing more.

An app is a package `<name>/` (the shipped ones live in `apps/`) with
- `model.py`: its model args (a dataclass, validated in `__post_init__`; its `ARCHITECTURE` names the fields that
  make another model), its model (an `AppModel`) and `build_<name>(args, tokenizer)`;
- `train.py`: `<Name>TrainArgs(TrainArgs)` adding `model: <Name>Args`, and a module-level `APP = App(...)`
  (checkpoints store the module's name and rebuild the model through it), then `main(APP)`;
- `configs/*.yaml` (`debug.yaml`, `single_scale.yaml` and `scaling_*.yaml` are found by the tools when present).
The tools find an app by name: `bert` is `apps/bert`, any other importable package `toy` with a `toy/train.py`
works the same (`tools.benchmark apps=toy`); every package of `apps/` with a train.py is registered
(`apps.registered_apps`), and the tests iterate over them. A checkpoint rebuilds its model through the app it names
only when that is one of these or the app named on the command line (`trusted_app`): opening one imports nothing
else. An app that trains on something other than packed text rows (contrastive triplets) gives its own
`DataPipeline`; one that starts from another app's weights gives `load_init`
(and `configure`, to take that run's shapes); one scored otherwise than by a loss on held-out rows gives `validate`
(fine-tuning: dev-set metrics); one measured otherwise too during training registers `evaluations` (the shipped
apps: the frozen GLUE probes, with an `eval` section in their TrainArgs; an app of yours: e.g. an STS score); one
that predicts `<mask>`ed tokens declares how on its model (`AppModel.masked_lm`), which the export follows; one
whose attention can keep each token to its own document of a row (data.document_mask) says so (`masks_documents`)
and passes the ids `with_document_ids` adds to its batch on to attention.
`configure` decides and reads no file: the loop reads, once, what the run starts from (lingua/training/resume.py
`Start`: init_from opened, the resumed run's config, the data pipeline's `check`). The loop builds the model on the
meta device, parallelises it, materialises it and calls `init_weights`; it owns the data, the optimizer, the
schedule, checkpoints, logging and the random generator; the model owns its masking, its loss, its FLOPs and its
shape. No app imports another: what several apps share lives in `lingua/` (e.g. `lingua/model/masking.py`).
"""

import abc
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lingua.args import from_dict, load_config
from lingua.checkpoint.store import Checkpoint, short_reason
from lingua.data.loader import build_train_loader, document_ids, document_start, load_validation, repartition
from lingua.data.tokenizer import build_tokenizer
from lingua.distributed import DistributedArgs, Launch
from lingua.errors import UserError
from lingua.model.pooler import AttentionPooler
from lingua.model.scaling import ScalingLaws
from lingua.model.transformer import Encoder, PreNormBlock, TransformerArgs, init_weights, trunc_normal_
from lingua.parallel import parallelize

MASKED_LM_READS = ("encoder", "cross_attention", "self_attention")  # the states a masked-LM head may read, which the
# export knows how to compute (lingua/export/template/modeling_lingua.py)


@dataclass(frozen=True)
class MaskedLMHead:
    """How an app's model predicts a `<mask>`ed token outside training, declared by the app (`AppModel.masked_lm`):
    the output head tied to the backbone's token embedding, on the states that `reads` names, computed by the model's
    network `network` (its shapes in `.args`). The export (AutoModelForMaskedLM) and its model card follow it.

    `reads`: "encoder", the backbone's final states over the masked row (no network); "cross_attention", a network
    whose learned mask embedding at every position reads, through cross-attention blocks and a final norm, the
    backbone's states of the tokens other than `<mask>` (projected in and out when its width is not the backbone's);
    "self_attention", a network of self-attention blocks and a final norm over the backbone's token embeddings of the
    masked row."""

    reads: str  # one of MASKED_LM_READS
    description: str  # what it is, in the model card: e.g. "CrossBERT's predictor"
    network: str = ""  # the model's attribute holding the network ("" when it reads the encoder's states)
    output_bias: bool = True  # the tied head adds the backbone's `output_bias`, when the backbone has one

    def __post_init__(self):
        if self.reads not in MASKED_LM_READS:
            raise ValueError(f"MaskedLMHead.reads must be one of {', '.join(MASKED_LM_READS)}, got {self.reads!r}")
        if (self.reads == "encoder") != (not self.network):
            raise ValueError(f"a MaskedLMHead reading {self.reads!r} "
                             + ("takes no network" if self.network else "must name the model's network computing it"))


class AppModel(nn.Module, abc.ABC):
    """An app's model. An app writes the four abstract methods; the others have the defaults of a model whose
    backbone is the attribute `backbone_name` and whose batches hold `targets`, and are overridden where the app
    differs."""

    views_per_sequence = 1  # token-views per data sequence in one step (CrossBERT with CMS: 2): throughput, compute
    backbone_name = "encoder"  # the attribute holding the `Encoder` that `encode` runs
    evaluation_methods: tuple[str, ...] = ("encode",)  # what evaluation calls instead of forward (FSDP gathers the
    # weights for them too)
    masked_lm: MaskedLMHead | None = None  # how it predicts a `<mask>`ed token outside training (the export's
    # AutoModelForMaskedLM); None: it predicts no token (e.g. a contrastive or fine-tuning model)
    masks_documents = False  # its make_batch and forward keep each token to its own document (`with_document_ids`)
    document_start: int | None = None  # the token starting each document of a row, set by `separate_documents`

    @abc.abstractmethod
    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The inputs of `forward` for a batch of token rows [B, S]. Every random draw of a step is made here, from
        `generator` (the loop's, checkpointed: a resumed run draws the same); randomness that `forward` needs
        (e.g. uniforms for sampling) travels in the batch, so `forward` stays deterministic and compilable. Every
        tensor has the batch first (validation splits rows over ranks) and a shape that does not depend on the
        draw."""

    @abc.abstractmethod
    def forward(self, **batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, stats): the scalar loss to minimise and scalar tensors the loop logs as means over the logging
        window and the ranks (e.g. accuracy, each term of a composite loss). No host sync, no random draw."""

    @abc.abstractmethod
    def flops_per_token_view(self, seq_len: int) -> float:
        """Training FLOPs per token-view (forward and backward), as the paper counts them (eq. 7-8): the compute C."""

    @abc.abstractmethod
    def head_flops_per_token_view(self, seq_len: int) -> float:
        """The FLOPs per token-view of the output heads that `flops_per_token_view` leaves out (the paper's
        convention); the sum of both is what a step runs, and what MFU counts."""

    def hardware_flops_per_token_view(self, seq_len: int) -> float:
        """The FLOPs per token-view the kernels run (`mfu_hw`): every matmul, heads included, and attention over the
        keys each query actually sees. Default: the paper's count with its heads, right for a model whose every
        token attends over the whole row."""
        return self.flops_per_token_view(seq_len) + self.head_flops_per_token_view(seq_len)

    def separate_documents(self, start: int | None) -> None:
        """From now on each token of a batch's rows attends only to its own document, each starting at the token
        `start` (data.document_mask: <s>); None: to its whole row, the default. A model that cannot refuses."""
        if start is not None and not self.masks_documents:
            raise UserError(f"data.document_mask: {type(self).__name__} cannot keep tokens to their own document")
        self.document_start = start

    def with_document_ids(self, batch: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """`make_batch`'s batch, plus `document_ids` [B, S] (which document each token of the rows `tokens` is) when
        documents are separated: from the rows as loaded, before any masking or corruption, once per batch."""
        if self.document_start is not None:
            batch["document_ids"] = document_ids(tokens, self.document_start)
        return batch

    @property
    def backbone(self) -> Encoder:
        """The encoder whose states `encode` returns: what embeddings, contrastive training and fine-tuning start
        from."""
        return getattr(self, self.backbone_name)

    def encode(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None, all_layers: bool = False):
        """The frozen representation for evaluation: the full, unmasked sequence [B, S] -> hidden states [B, S, D]
        after the final norm (padding, pad_mask False, hidden), or every layer's output with all_layers."""
        return self.backbone.encode(tokens, pad_mask, all_layers)

    def predicted_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens predicted in this batch, from shapes only (no sync): logged as predicted_tokens_per_s."""
        return batch["targets"].numel()

    def sharding_units(self) -> list[nn.Module]:
        """The modules FSDP shards, compiles and checkpoints one by one: every transformer block, in module order;
        the rest (the embedding and tied head) stays with the root."""
        return [module for module in self.modules() if isinstance(module, PreNormBlock)]

    def init_weights(self) -> None:
        """Fills every parameter and buffer after materialisation from the meta device (under torch.no_grad)."""
        init_weights(self, self.backbone.args.init_std)
        for module in self.modules():
            if isinstance(module, AttentionPooler):
                trunc_normal_(module.query, self.backbone.args.init_std)

    def attention_pooler(self) -> AttentionPooler | None:
        """The model's own attention pooler (a contrastive or fine-tuning run's), which its embeddings and its export
        read; None: they mean-pool."""
        return None

    def classifier(self) -> tuple[nn.Linear, str] | None:
        """A classification head and the pooling whose vector it reads ("mean", "first" or "attention"), which the
        export carries (AutoModelForSequenceClassification); None: the model has none."""
        return None

    def pooler_warm_start(self) -> tuple[TransformerArgs, dict[str, torch.Tensor]] | None:
        """What starts another run's attention pooler (lingua/training/pretrained.py): its block shapes and its
        weights under the pooler's names (lingua/model/pooler.py); by default the model's own attention pooler,
        None without one (a cold start)."""
        pooler = self.attention_pooler()
        return (pooler.args, pooler.state_dict()) if pooler is not None else None


@dataclass(frozen=True)
class DataPipeline:
    """Where an app's batches come from. Each batch is a LongTensor with the batch first (it goes to `make_batch`);
    every function takes the config's `data` section."""

    build_loader: Callable  # (data args, tokenizer, rank, world_size, state or None) -> endless iterator of batches
    # with state_dict() (plain JSON: where the next batch starts), malformed_lines and close()
    load_validation: Callable  # (data args, tokenizer, n_rows) -> fixed validation rows, the batch first (a tensor,
    # or lingua.data.loader.ValidationRows: rows of several sources)
    repartition: Callable  # (states saved by N ranks, world_size, data args) -> one state per new rank
    row_shape: Callable  # (data args) -> the shape of one row of a batch, e.g. (seq_len,)
    check: Callable = lambda args: {}  # (data args as given) -> facts `configure` decides from, e.g. {"train_rows":
    # N}; reads the data at the start, so that bad data stops the run before anything is written
    document_start: Callable = lambda args, tokenizer: None  # (data args, tokenizer) -> the token that starts each
    # document of a row when each token must attend only to its own document (`AppModel.separate_documents`), or None


TEXT = DataPipeline(build_train_loader, load_validation, repartition, lambda args: (args.seq_len,),
                    document_start=document_start)


@dataclass
class App:
    name: str  # the module that defines APP, e.g. "apps.bert.train"; stored with checkpoints to rebuild the model
    args_cls: type  # a TrainArgs subclass with a `model` field
    build_model: Callable[[Any, Any], AppModel]  # (model args, tokenizer) -> model, called on the meta device
    data: DataPipeline = TEXT  # packed rows of the text corpus (lingua/data/loader.py)
    configure: Callable[[Any, Any], Any] | None = None  # (config, lingua.training.resume.Start) -> the config the run
    # trains with (e.g. init_from's shapes); it decides from what it is given and reads no file
    load_init: Callable[[Any, Any], dict] | None = None  # (init_from's Checkpoint, model) -> the config it was
    # trained with; default: the checkpoint's weights into the model as it is (Checkpoint.load_into)
    validate: Callable | None = None  # (model, validation rows, ValidationArgs, data args, device, Launch) ->
    # {"val/...": value}, equal on every rank: the app's own validation, in place of the loss on the validation rows
    evaluations: tuple = ()  # the kinds of evaluation the loop runs during training after the validation, each a
    # lingua.training.validation.EvaluationKind: check(config, world_size), build(EvalContext) -> an Evaluation (name,
    # keep_best ("": none), due(step), run(step)) or None; e.g. GLUE_PROBES, with an `eval` section in the config
    parallelize: Callable | None = None  # (model, DistributedArgs, Launch, device): the app's own parallelism
    # plan; default: activation checkpointing, compile and FSDP2 per sharding unit (lingua/parallel.py)
    scaling: ScalingLaws | None = None  # its batch-size and learning-rate laws, for `tools.scaling plan`
    variants: dict[str, list[str]] = field(default_factory=dict)  # named model settings worth testing and
    # benchmarking beside the defaults, e.g. {"no CMS": ["cms=false"]}

    @property
    def model_args_cls(self) -> type:
        """The dataclass of the `model` section of the app's config."""
        return typing.get_type_hints(self.args_cls)["model"]

    @property
    def short_name(self) -> str:
        """The name the tools take: `bert` for apps.bert.train, `toy` for toy.train."""
        return short_name(self.name)

    @property
    def folder(self) -> Path:
        """The app's package folder (its configs/ are there)."""
        return Path(import_module(self.name).__file__).parent

    def config(self, name: str) -> Path | None:
        """The app's configs/NAME.yaml, if it has one."""
        path = self.folder / "configs" / f"{name}.yaml"
        return path if path.exists() else None


def short_name(module: str) -> str:
    """An app's name from the module that defines it: `bert` for apps.bert.train, `toy` for toy.train."""
    return module.removesuffix(".train").removeprefix("apps.")


APPS_FOLDER = Path(__file__).resolve().parents[1] / "apps"  # the apps shipped with this code, beside lingua/


def shipped_apps() -> list[str]:
    """The names of this code's apps: the packages of the apps folder beside lingua/ with a train.py, found by
    listing the folder (nothing is imported)."""
    found = APPS_FOLDER.iterdir() if APPS_FOLDER.is_dir() else []
    return sorted(p.name for p in found if p.name.isidentifier() and (p / "__init__.py").is_file()
                  and (p / "train.py").is_file())


def shipped_module(saved: str) -> str | None:
    """The module of this code's app that `saved` (the app a checkpoint names) is, `apps.bert.train` for
    `apps.bert.train` or `bert`; None for any other name."""
    name = short_name(saved)
    return f"apps.{name}.train" if name in shipped_apps() and saved in (name, f"apps.{name}.train") else None


class UntrustedApp(UserError):
    """A checkpoint names an app that is neither one of this code's nor the one named on the command line."""

    def __init__(self, where: str, saved: str, named: str | None):
        # `saved` is read from the file: quoted, so that no newline or terminal escape in it reaches the user's
        # terminal, and offered as app= only when it is a module's name
        self.refusal = (f"{where} was saved by app {saved!r}, which is {'neither ' if named else 'not '}one of this "
                        f"code's apps ({', '.join(shipped_apps())}){f' nor {named}' if named else ''}: nothing was "
                        "imported")
        dotted = all(part.isidentifier() for part in saved.split("."))
        super().__init__(f"{self.refusal}; if you trust it, run again with app={saved}" if dotted else self.refusal)


def trusted_app(saved: str, named: str | None, where: str) -> App:
    """The app that rebuilds a model saved by the app `saved` (what `where`, a checkpoint, names): one of this code's
    apps, or the one the user named on the command line (`named`: `load_app` resolves it). A checkpoint from
    elsewhere names whatever it likes (`this`, a train.py it brought along): any other name is refused before
    anything is imported."""
    module = shipped_module(saved)
    if module is not None:
        return load_app(module)
    if named and short_name(named) == short_name(saved):
        return load_app(named)
    raise UntrustedApp(where, saved, named)


def load_app(name: str) -> App:
    """The App that `name` names: an app (`bert`: apps/bert/train.py; `toy`: the package toy's train.py, an app
    outside apps/) or the module that defines APP (`apps.bert.train`: what checkpoints store and stool runs)."""
    importable = all(part.isidentifier() for part in name.split("."))
    for module in (f"apps.{name}.train", f"{name}.train", name) if importable else ():
        try:
            found = import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not f"{module}.".startswith(f"{e.name}."):
                raise  # the app exists but imports something missing
            continue
        if isinstance(getattr(found, "APP", None), App):
            return found.APP
    raise UserError(f"unknown app '{name}' (not a module defining APP, nor a package with a train.py that does: e.g. "
                    "apps.bert.train, bert for apps/bert/)")


def app_variant(label: str, base: dict[str, Any]) -> tuple[App, Any]:
    """`name` or `name+key=value+...` (e.g. `crossbert+cms=false`): the app and its model args, from `base` (a
    nested dict of model fields) and then the label's overrides."""
    name, *overrides = label.split("+")
    app = load_app(name.strip())
    return app, load_config(app.model_args_cls, overrides, base=base)


def build_model(build_fn, model_args, tokenizer, device: torch.device, seed: int = 0,
                parallel: tuple[DistributedArgs, Launch] | None = None, plan: Callable | None = None) -> nn.Module:
    """The one way models are built, for training and for loading: on the meta device (no memory), parallelised
    when asked (`parallel`: by `plan`, an app's own, else per sharding unit), materialised on `device`, then
    initialised from `seed` (`init_weights`)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_fn(model_args, tokenizer)
    if parallel is not None:
        if plan is not None:
            plan(model, *parallel, device)
        else:
            parallelize(model, model.sharding_units(), *parallel, device)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model


def checkpoint_app(checkpoint: Checkpoint) -> App:
    """The app that rebuilds a checkpoint's model: the one it names if that is one of this code's, or the one the
    user named for this command (`Checkpoint.open(path, app)`); any other is refused before it is imported."""
    return trusted_app(checkpoint.app_name, checkpoint.named_app, f"checkpoint {checkpoint.path}")


def build_from_params(params: dict, device: str | torch.device = "cpu", app: str | None = None,
                      where: str = "the checkpoint"):
    """The (initialised, untrained) model, config and tokenizer of {"app": module, "config": dict}, built by one of
    this code's apps or by `app`, the one the user named on the command line; any other app is refused, unimported."""
    name = params["app"]
    try:
        builder = trusted_app(name, app, where)
    except ImportError as e:  # the app is there, but not what it imports
        raise UserError(f"{where}'s app {name!r} cannot be imported ({short_reason(e)})") from None
    config = from_dict(builder.args_cls, params["config"])
    tokenizer = build_tokenizer(config.data.tokenizer)
    return build_model(builder.build_model, config.model, tokenizer, torch.device(device)), config, tokenizer


def build_checkpoint_model(checkpoint: Checkpoint, device: str | torch.device = "cpu"):
    """The model of a checkpoint's config, initialised (no weight is read), its config and its tokenizer."""
    return build_from_params(checkpoint.params, device, checkpoint.named_app, f"checkpoint {checkpoint.path}")


def load_model(source: str | Path | Checkpoint, device: str | torch.device = "cpu", app: str | None = None):
    """The trained model (eval mode), its config and its tokenizer, built from the checkpoint's own config: `source`
    an opened Checkpoint or anything `Checkpoint.open` accepts (`app`: as there)."""
    checkpoint = source if isinstance(source, Checkpoint) else Checkpoint.open(source, app)
    model, config, tokenizer = build_checkpoint_model(checkpoint, device)
    mismatched = checkpoint.mismatches(model)
    if mismatched:  # the model was rebuilt from the checkpoint's own config: its files do not match it
        raise UserError(f"checkpoint {checkpoint.path} is damaged: its tensors do not match its config (first: "
                        f"{mismatched[0]})")
    checkpoint.load_into(model)
    return model.eval(), config, tokenizer
