"""Starting an app from another run's backbone (contrastive probing, fine-tuning): the pre-trained run's encoder shape
and tokenizer, its weights, and a warm start of the attention pooler from a model that offers one
(`pooler_warm_start`: CrossBERT's predictor, the paper's section 3 and Appendix D; a contrastive or fine-tuning run's
own pooler) of the config's shape. The app's model holds the backbone as `encoder` and the pooler as `pooler` (an
`AttentionPooler` or None), its args `encoder` (TransformerArgs) and `pooler` (PoolerArgs)."""

from dataclasses import replace

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from lingua.app import UntrustedApp, build_checkpoint_model, checkpoint_app, load_model
from lingua.args import from_dict, to_dict
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError
from lingua.model.pooler import PoolerArgs, pooler_transformer
from lingua.model.transformer import TransformerArgs, head_dim_of
from lingua.training.resume import Start

RUNTIME_KEYS = ("attn_backend", "head_chunk")  # the encoder's settings that are this run's choice, not the model's


def adopt_pretrained(config, start: Start, attention_pooler: bool):
    """The config with the encoder shape and tokenizer of the pre-trained run (a new run's init_from, opened by
    lingua/training/resume.py's Start), or those the resumed run started with. The attention pooler keeps the config's
    shape (`model.pooler`, the same for every app compared); when it warm-starts (`attention_pooler` and a source that
    offers one), what starts it must have that shape."""
    source = start.resumed or (start.init_from.config if start.init_from is not None else None)
    if source is None or not config.init_from:
        return config
    if start.init_from is not None:
        check_trusted(start.init_from)
    encoder = {k: v for k, v in source["model"]["encoder"].items() if k not in RUNTIME_KEYS}
    model = replace(config.model, encoder=replace(config.model.encoder, **encoder))
    if start.init_from is not None and attention_pooler:
        pretrained = build_checkpoint_model(start.init_from, "meta")[0]  # shapes only: no weight is read
        if _warm_starts(model.pooler, pretrained):
            check_warm_start_shape(pooler_transformer(model.pooler, model.encoder), pretrained.pooler_warm_start()[0])
    tokenizer = from_dict(type(config.data.tokenizer), source["data"]["tokenizer"])
    return replace(config, model=model, data=replace(config.data, tokenizer=tokenizer))


def check_trusted(init_from: Checkpoint) -> None:
    """init_from's model is rebuilt by the app it names only if that is one of this code's apps or this run's (a
    training command names no other), checked before anything is imported or written."""
    try:
        checkpoint_app(init_from)
    except UntrustedApp as e:
        raise UserError(f"init_from: {e.refusal}") from None


def check_warm_start_shape(pooler: TransformerArgs, source: TransformerArgs) -> None:
    """The pooler's shape is the config's, for every app alike (a cold start has it too): a warm start must fill it."""
    ours, theirs = [(a.n_layers, a.n_heads, head_dim_of(a)) for a in (pooler, source)]
    if ours != theirs:
        raise UserError(f"model.pooler has {ours[0]} layers of {ours[1]} heads of {ours[2]}, what warm-starts it "
                        f"{theirs[0]} of {theirs[1]} of {theirs[2]}: set model.pooler.n_layers={theirs[0]} "
                        f"model.pooler.n_heads={theirs[1]} (and the same for every app compared), or "
                        "model.pooler.warm_start=false")


def _warm_starts(pooler: PoolerArgs, pretrained) -> bool:
    return pooler.warm_start and pretrained.pooler_warm_start() is not None


def load_pretrained(checkpoint: Checkpoint, model) -> dict:
    """The backbone's weights of any app's checkpoint into the model's backbone, and the warm start into its
    attention pooler when it has one and the checkpoint offers it; the rest of the model keeps its initialisation.
    Returns the part of the checkpoint's config that the run must match (its encoder and tokenizer)."""
    source, config, _ = load_model(checkpoint, "cpu")
    state = {f"{model.backbone_name}.{k}": v for k, v in source.backbone.state_dict().items()}
    pooler = model.attention_pooler()
    if pooler is not None and _warm_starts(model.args.pooler, source):
        prefix = next(name for name, module in model.named_modules() if module is pooler)
        state |= {f"{prefix}.{k}": v for k, v in source.pooler_warm_start()[1].items()}
    expected = dict(model.state_dict())
    mismatched = sorted(k for k, v in state.items() if k not in expected or expected[k].shape != v.shape)
    if mismatched:
        raise UserError(f"{checkpoint.path}: its weights do not fit this model (first: {mismatched[0]})")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return {"model": {"encoder": to_dict(config.model.encoder)}, "data": {"tokenizer": to_dict(config.data.tokenizer)}}
