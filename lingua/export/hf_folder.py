"""Export a checkpoint of any app to a folder that HuggingFace `transformers` and `sentence-transformers` load:

    python -m lingua.export ckpt=DUMP_DIR_OR_CHECKPOINT out=FOLDER [pooling=auto|mean] [max_len=0] [app=NAME]

The folder holds the model in plain PyTorch (`modeling_lingua.py`, `configuration_lingua.py`: no Lingua needed to
load it), its weights (`model.safetensors`), the tokenizer (`tokenizer.json`: GPT-2's BPE, the bytes one or the run's
Hugging Face one, with `<s> text </s>` added and the run's special ids; `tokenizer_config.json` names
`PreTrainedTokenizerFast`, so it loads with no
code from the folder: `AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=False)`), the files that make
`SentenceTransformer(FOLDER, trust_remote_code=True)` return the model's `pooler_output`, and a model card
(`README.md`). Vectors and states are those of `lingua.export.embedder.load_embedder(ckpt, pooling=, max_len=)` and
`model.encode`. config.json's `auto_map` names:

- `AutoModel`: the final states and the sentence embedding;
- `AutoModelForSequenceClassification`: a linear head on the vector that `classifier_pooling` names (the mean, the
  first token's state or the attention pooler's, not normalised). A model that declares a classifier
  (`AppModel.classifier`: a fine-tuning run's) gives its head, its pooling and its GLUE task's label names; any other
  run a fresh head (`num_labels=N` when loading) on its pooler's vector (`AppModel.attention_pooler`), or on the mean
  without one;
- `AutoModelForTokenClassification`: a fresh linear head on every token's state;
- `AutoModelForMaskedLM` (and the fill-mask pipeline), only for a model that declares a masked-LM head (BERT,
  CrossBERT, ELECTRA: `AppModel.masked_lm`, a lingua.app.MaskedLMHead): its predictions at the `<mask>` tokens. The
  tokenizer of such an export parses the special tokens written in a text (`<mask>` is how a text asks for a
  prediction); sentence-transformers, and `tokenizer(text, split_special_tokens=True)`, read them as text, as Lingua
  does and as every other export's tokenizer does.

Needs `transformers` (its tiktoken converter builds the tokenizer). FOLDER is new, empty or an earlier export (its
`lingua_export.json` names the files it holds), with nothing else in it: any other folder, or an export holding files
the user added, is refused and left untouched (`lingua.files.written_folder`). The export is written beside it, flushed
to disk, then renamed into its place: a reader, or a kill at any moment, sees the earlier export whole or the new
one, never a mix (a kill between the two renames is repaired by the next export into FOLDER).
"""

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lingua.app import MaskedLMHead
from lingua.args import command_line, load_config
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError
from lingua.eval.glue_data import TASKS
from lingua.export.card import model_card
from lingua.export.embedder import Embedder, load_embedder
from lingua.export.tokenizer import hf_tokenizer, tokenizer_config
from lingua.files.safe import atomic_write, fsync_dir
from lingua.files.written_folder import marker_text, not_written, remove
from lingua.metrics import setup_logging
from lingua.model.transformer import ffn_hidden_dim, head_dim_of

TEMPLATE_DIR = Path(__file__).parent / "template"
CODE_FILES = ("configuration_lingua.py", "modeling_lingua.py")
NEEDED_PACKAGES = ("transformers", "tokenizers", "safetensors")
MARKER = "lingua_export.json"  # in every export: what a later export into the same folder may replace


@dataclass
class ExportArgs:
    ckpt: str = ""  # a run's dump_dir (its newest checkpoint, else consolidated.pt), a checkpoint folder or a .pt file
    out: str = ""  # the folder to write
    pooling: str = "auto"  # auto: the model's trained pooler if it has one, else mean | mean: always the mean
    max_len: int = 0  # tokens per text, <s> and </s> included; 0: the run's training length
    app: str = ""  # ckpt's app when not one of this code's (e.g. my_pkg.my_app): trusted to rebuild it


def export(args: ExportArgs) -> Path:
    """Writes the folder (load_embedder checks pooling and max_len); returns its path."""
    if not args.ckpt or not args.out:
        raise UserError("ckpt= and out= are required: the checkpoint to export and the folder to write")
    missing = [name for name in NEEDED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"export needs {', '.join(missing)}: pip install {' '.join(missing)}")
    out = Path(args.out).resolve()  # `out=.` has a name, and a link the folder it points to
    repair_interrupted(out)
    check_replaceable(out)
    checkpoint = Checkpoint.open(args.ckpt, args.app or None)
    embedder = load_embedder(str(checkpoint.path), "cpu", args.pooling, args.max_len, args.app or None)
    params = checkpoint.params
    model = embedder.model
    pooler = model.attention_pooler() if args.pooling == "auto" else None
    classifier = model.classifier()
    if classifier is not None and classifier[1] == "attention" and pooler is None:
        raise UserError("pooling=mean would leave out the attention pooler that this run's classifier reads")
    masked_lm = model.masked_lm
    config = hf_config(embedder, pooler, masked_lm, params["config"])
    files = {
        "config.json": json_text(config),
        **{name: (TEMPLATE_DIR / name).read_text() for name in CODE_FILES},
        "tokenizer.json": hf_tokenizer(embedder, params["config"]["data"]["tokenizer"]["name"]).to_str(),
        "tokenizer_config.json": json_text(tokenizer_config(embedder, parse_special_tokens=masked_lm is not None)),
        **sentence_transformers_files(embedder.max_len),
        "README.md": model_card(checkpoint.path, params, embedder, pooler, masked_lm, config),
        "model.safetensors": safetensors_bytes(hf_state_dict(model, pooler, masked_lm)),
    }
    files[MARKER] = marker_text(files, MARKER, exported_by="python -m lingua.export", ckpt=str(checkpoint.path))
    try:
        write_folder(out, files)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    return out


# ---------------------------------------------------------------------------------------------- the folder


def check_replaceable(out: Path) -> None:
    """The export goes into a new or empty folder, or over an earlier export: never over files of another kind,
    nor over an earlier export with files added to it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"out={out} is a file, not a folder")
    foreign = not_written(out, MARKER) if out.is_dir() else []
    if foreign and not (out / MARKER).is_file():
        raise UserError(f"out={out} holds files that are not an export (no {MARKER}): export into a new or empty "
                        "folder, or over an earlier export")
    if foreign:
        raise UserError(f"out={out} holds files that the earlier export did not write ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}): move them out of it, or export into another folder")


def beside(out: Path) -> tuple[Path, Path]:
    """The folders an export uses next to `out`: the new export being written, the earlier one renamed aside."""
    return out.with_name(f".{out.name}.export-partial"), out.with_name(f".{out.name}.export-previous")


def repair_interrupted(out: Path) -> None:
    """Clears what an interrupted export (killed, or failed) left: an earlier export renamed aside goes back in
    place when no new one took it, else it goes; a partial one goes. Only what their markers list is removed."""
    partial, previous = beside(out)
    if (previous / MARKER).is_file() and not out.exists():
        previous.rename(out)
    for folder in (partial, previous):
        remove(folder, MARKER)


def write_folder(out: Path, files: dict[str, str | bytes]) -> None:
    """Writes the files into a new folder beside `out`, its marker (which lists them) first, flushed to disk, then
    renames it into out's place (an earlier export is renamed aside first and removed last). A failure leaves the
    earlier export in place."""
    partial, previous = beside(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    try:
        for name in sorted(files, key=lambda name: name != MARKER):
            atomic_write(partial / name, files[name])
        fsync_dir(partial)
        if out.exists():
            out.rename(previous)
        partial.rename(out)
        fsync_dir(out.parent)
    finally:
        repair_interrupted(out)


def json_text(value) -> str:
    return json.dumps(value, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------- model and weights


def hf_config(embedder: Embedder, pooler, masked_lm: MaskedLMHead | None, train: dict) -> dict:
    """config.json: the fields of configuration_lingua.LinguaConfig, and the classes that the Auto classes load."""
    model, tokenizer = embedder.model, embedder.tokenizer
    backbone = model.backbone
    encoder = backbone.args
    classes = {"AutoModel": "LinguaModel", "AutoModelForSequenceClassification": "LinguaForSequenceClassification",
               "AutoModelForTokenClassification": "LinguaForTokenClassification",
               **({"AutoModelForMaskedLM": "LinguaForMaskedLM"} if masked_lm else {})}
    return {
        "architectures": ["LinguaModel" if model.classifier() is None else "LinguaForSequenceClassification"],
        "auto_map": {"AutoConfig": "configuration_lingua.LinguaConfig",
                     **{auto: f"modeling_lingua.{name}" for auto, name in classes.items()}},
        "model_type": "lingua",
        "dtype": str(backbone.tok_embeddings.weight.dtype).removeprefix("torch."),
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": encoder.dim,
        "num_hidden_layers": encoder.n_layers,
        "num_attention_heads": encoder.n_heads,
        "head_dim": head_dim_of(encoder),
        "intermediate_size": ffn_hidden_dim(encoder.dim, encoder.ffn_multiple_of),
        "rms_norm_eps": encoder.norm_eps,
        "rope_theta": encoder.rope_theta,
        "max_position_embeddings": encoder.max_seqlen,
        "scale_embeddings": encoder.scale_embeddings,
        "pooling": "mean" if pooler is None else "attention",
        **shape_fields("pooler_", pooler),
        **classifier_fields(model, pooler, train),
        **masked_lm_fields(model, masked_lm),
        "initializer_range": encoder.init_std,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "mask_token_id": tokenizer.mask_id,
    }


def shape_fields(prefix: str, network) -> dict:
    """The depth and heads of a network beside the encoder (the pooler, a masked-LM head's network); zeros for
    none."""
    args = None if network is None else network.args
    return {f"{prefix}num_layers": args.n_layers if args else 0,
            f"{prefix}num_attention_heads": args.n_heads if args else 0,
            f"{prefix}head_dim": head_dim_of(args) if args else 0}


def classifier_fields(model: torch.nn.Module, pooler, train: dict) -> dict:
    """What LinguaForSequenceClassification reads: a fine-tuning run's head (its pooling, and its GLUE task's label
    names), else a fresh head on the pooler's vector, or on the mean without a pooler."""
    classifier = model.classifier()
    if classifier is None:
        return {"classifier_pooling": "mean" if pooler is None else "attention"}
    head, pooling = classifier
    n_labels = head.out_features
    task = TASKS.get(train["data"].get("task"))
    names = task.labels if task and len(task.labels) == n_labels else [f"LABEL_{i}" for i in range(n_labels)]
    return {"classifier_pooling": pooling,
            "problem_type": "regression" if n_labels == 1 else "single_label_classification",
            "id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


def masked_lm_parts(model: torch.nn.Module, masked_lm: MaskedLMHead) -> tuple:
    """(network, output bias) of the model's declared masked-LM head, each None where it has none."""
    network = getattr(model, masked_lm.network) if masked_lm.network else None
    return network, model.backbone.output_bias if masked_lm.output_bias else None


def masked_lm_fields(model: torch.nn.Module, masked_lm: MaskedLMHead | None) -> dict:
    """What LinguaForMaskedLM reads: the states the tied head reads, the network that computes them, and the tied
    head's bias."""
    if masked_lm is None:
        return {"masked_lm": "none"}
    network, output_bias = masked_lm_parts(model, masked_lm)
    shape = {} if network is None else {
        **shape_fields("mlm_", network), "mlm_hidden_size": network.args.dim,
        "mlm_intermediate_size": ffn_hidden_dim(network.args.dim, network.args.ffn_multiple_of),
        "mlm_rope_theta": network.args.rope_theta}
    return {"masked_lm": masked_lm.reads, "mlm_output_bias": output_bias is not None, **shape}


def hf_state_dict(model: torch.nn.Module, pooler, masked_lm: MaskedLMHead | None) -> dict[str, torch.Tensor]:
    """modeling_lingua keeps the encoder's parameter names; the pooler's, the masked-LM head's network's and the
    classifier's are under `pooler.`, `mlm_network.` and `classifier.`; the tied head's bias is `output_bias`, kept
    when the masked-LM head reads it."""
    state = {name: value for name, value in model.backbone.state_dict().items() if name != "output_bias"}
    classifier = model.classifier()
    modules = {"pooler": pooler, "classifier": classifier[0] if classifier else None}
    if masked_lm is not None:
        modules["mlm_network"], output_bias = masked_lm_parts(model, masked_lm)
        if output_bias is not None:
            state["output_bias"] = output_bias
    for prefix, module in modules.items():
        if module is not None:
            state |= {f"{prefix}.{name}": value for name, value in module.state_dict().items()}
    return {name: value.detach().cpu().contiguous() for name, value in state.items()}


def safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(state, metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ sentence-transformers


def sentence_transformers_files(max_len: int) -> dict[str, str]:
    """One module, sentence-transformers' Transformer, whose sentence embedding is the model's pooler_output (already
    normalised): no Pooling or Normalize module. Special tokens written in a text are text, as in Lingua, also where
    the tokenizer parses them (an export with a masked-LM head)."""
    module = "sentence_transformers.base.modules.transformer.Transformer"
    modules = [{"idx": 0, "name": "0", "path": "", "type": module}]
    module_config = {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "pooler_output"}},
        "processing_kwargs": {"text": {"split_special_tokens": True}},
        "module_output_name": "sentence_embedding",
        "max_seq_length": max_len,
        "do_lower_case": False,
    }
    model_config = {"model_type": "SentenceTransformer", "similarity_fn_name": "cosine"}
    return {"modules.json": json_text(modules), "sentence_bert_config.json": json_text(module_config),
            "config_sentence_transformers.json": json_text(model_config)}


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(ExportArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        print(f"wrote {export(args)}")
