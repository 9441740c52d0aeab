"""Export a checkpoint of any app to a folder that HuggingFace `transformers` and `sentence-transformers` load:

    python -m lingua.export ckpt=DUMP_DIR_OR_CHECKPOINT out=FOLDER [pooling=auto|mean] [max_len=0]

The folder holds the encoder in plain PyTorch (`modeling_lingua.py`, `configuration_lingua.py`: no Lingua needed to
load it), its weights (`model.safetensors`), the tokenizer (`tokenizer.json`: GPT-2's BPE or the bytes one, with
`<s> text </s>` added and our special ids), the files that make `SentenceTransformer(FOLDER, trust_remote_code=True)`
return the model's `pooler_output`, and a model card (`README.md`). Vectors and states are those of
`lingua.embed.load_embedder(ckpt, pooling=, max_len=)` and `model.encode`. Needs `transformers` (its tiktoken
converter builds the tokenizer); files of an earlier export in FOLDER are replaced.
"""

import importlib.util
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tiktoken_ext.openai_public import r50k_pat_str

from lingua.args import UserError, command_line, load_config
from lingua.checkpoint import Checkpoint
from lingua.embed import Embedder, load_embedder
from lingua.eval.report import format_table
from lingua.files import atomic_write
from lingua.metrics import setup_logging
from lingua.transformer import ffn_hidden_dim, head_dim_of

logger = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).parent / "export_template"
CODE_FILES = ("configuration_lingua.py", "modeling_lingua.py")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<mask>")  # at the tokenizer's bos, eos, pad and mask ids, in this order
NEEDED_PACKAGES = ("transformers", "tokenizers", "safetensors")


@dataclass
class ExportArgs:
    ckpt: str = ""  # consolidated.pt, a checkpoint folder, or a run's dump_dir (its newest checkpoint, else export)
    out: str = ""  # the folder to write
    pooling: str = "auto"  # auto: the model's trained pooler if it has one, else mean | mean: always the mean
    max_len: int = 0  # tokens per text, <s> and </s> included; 0: the run's training length


def export(args: ExportArgs) -> Path:
    """Writes the folder (load_embedder checks pooling and max_len); returns its path."""
    if not args.ckpt or not args.out:
        raise UserError("ckpt= and out= are required: the checkpoint to export and the folder to write")
    missing = [name for name in NEEDED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"export needs {', '.join(missing)}: pip install {' '.join(missing)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"out={out} is a file, not a folder")
    checkpoint = Checkpoint.open(args.ckpt)
    embedder = load_embedder(str(checkpoint.path), "cpu", args.pooling, args.max_len)
    params = checkpoint.params
    pooler = getattr(embedder.model, "pooler", None) if args.pooling == "auto" else None
    config = hf_config(embedder, pooler)
    files = {
        "config.json": json_text(config),
        **{name: (TEMPLATE_DIR / name).read_text() for name in CODE_FILES},
        "tokenizer.json": hf_tokenizer(embedder, params["config"]["data"]["tokenizer"]["name"]).to_str(),
        "tokenizer_config.json": json_text(tokenizer_config(embedder)),
        **sentence_transformers_files(embedder.max_len),
        "README.md": model_card(checkpoint.path, params, embedder, pooler, config),
    }
    try:
        for name, text in files.items():
            atomic_write(out / name, text)
        atomic_write(out / "model.safetensors", safetensors_bytes(embedder.model.backbone, pooler))
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    return out


def json_text(value) -> str:
    return json.dumps(value, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------- model and weights


def hf_config(embedder: Embedder, pooler) -> dict:
    """config.json: the fields of configuration_lingua.LinguaConfig, and the classes that AutoModel loads."""
    backbone, tokenizer = embedder.model.backbone, embedder.tokenizer
    encoder = backbone.args
    pooler_shape = {"pooler_num_layers": 0, "pooler_num_attention_heads": 0, "pooler_head_dim": 0}
    if pooler is not None:
        pooler_shape = {"pooler_num_layers": pooler.args.n_layers, "pooler_num_attention_heads": pooler.args.n_heads,
                        "pooler_head_dim": head_dim_of(pooler.args)}
    return {
        "architectures": ["LinguaModel"],
        "auto_map": {"AutoConfig": "configuration_lingua.LinguaConfig", "AutoModel": "modeling_lingua.LinguaModel"},
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
        **pooler_shape,
        "initializer_range": encoder.init_std,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "mask_token_id": tokenizer.mask_id,
    }


def hf_state_dict(backbone: torch.nn.Module, pooler) -> dict[str, torch.Tensor]:
    """modeling_lingua.LinguaModel keeps the encoder's parameter names, and the pooler's under `pooler.`; the output
    head's bias is pre-training's only, not the encoder's."""
    state = {name: value for name, value in backbone.state_dict().items() if name != "output_bias"}
    if pooler is not None:
        state |= {f"pooler.{name}": value for name, value in pooler.state_dict().items()}
    return {name: value.detach().cpu().contiguous() for name, value in state.items()}


def safetensors_bytes(backbone: torch.nn.Module, pooler) -> bytes:
    from safetensors.torch import save

    return save(hf_state_dict(backbone, pooler), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------------ tokenizer


def hf_tokenizer(embedder: Embedder, name: str):
    """A `tokenizers.Tokenizer` giving our ids: `<s> text </s>` (`<s> a </s></s> b </s>` for pairs), the special
    tokens treated as text when they appear in it (tokenizer_config's split_special_tokens), as ours does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    ours = embedder.tokenizer
    vocab, merges = gpt2_vocab_and_merges(ours.encoding) if name == "gpt2" else byte_vocab()
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = pre_tokenizers.Split(Regex(r50k_pat_str), behavior="isolated")  # tiktoken's pre-split of r50k_base
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level]) if name == "gpt2" else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    if ids != [ours.bos_id, ours.eos_id, ours.pad_id, ours.mask_id]:
        raise RuntimeError(f"the exported special tokens got ids {ids}, ours are {ours.bos_id}..{ours.mask_id}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", ours.bos_id), ("</s>", ours.eos_id)])
    return tokenizer


def gpt2_vocab_and_merges(encoding) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """r50k_base's ranks as a byte-level BPE (transformers' tiktoken converter). <|endoftext|> keeps its id as an
    ordinary vocabulary entry: no text produces it, as `encode_ordinary` never does."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(pattern=r50k_pat_str)
    converter.load_tiktoken_bpe = lambda ranks: ranks  # it reads a file; we hand it the ranks already loaded
    vocab, merges = converter.extract_vocab_merges_from_model(encoding._mergeable_ranks)  # tiktoken's BPE ranks
    return {**vocab, "<|endoftext|>": encoding.eot_token}, merges


def byte_vocab() -> tuple[dict[str, int], list]:
    """One id per byte, as the ByteLevel pre-tokenizer spells bytes; no merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}, []


def tokenizer_config(embedder: Embedder) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "mask_token": "<mask>",
        "model_max_length": embedder.max_len,
        "split_special_tokens": True,  # "<s>" in a text is text, as in Lingua
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "padding_side": "right",
    }


# ------------------------------------------------------------------------------------------ sentence-transformers


def sentence_transformers_files(max_len: int) -> dict[str, str]:
    """One module, sentence-transformers' Transformer, whose sentence embedding is the model's pooler_output (already
    normalised): no Pooling or Normalize module."""
    module = "sentence_transformers.base.modules.transformer.Transformer"
    modules = [{"idx": 0, "name": "0", "path": "", "type": module}]
    module_config = {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "pooler_output"}},
        "module_output_name": "sentence_embedding",
        "max_seq_length": max_len,
        "do_lower_case": False,
    }
    model_config = {"model_type": "SentenceTransformer", "similarity_fn_name": "cosine"}
    return {"modules.json": json_text(modules), "sentence_bert_config.json": json_text(module_config),
            "config_sentence_transformers.json": json_text(model_config)}


# ----------------------------------------------------------------------------------------------------- model card


def run_folder(checkpoint: Path) -> Path:
    """DUMP_DIR for DUMP_DIR/checkpoints/NNN and DUMP_DIR/consolidated.pt."""
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return checkpoint.parent if checkpoint.is_file() else checkpoint


def last_metrics(run: Path) -> dict | None:
    """The last record of the run's metrics.jsonl that counts data tokens (a line that does not parse is skipped)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "data_tokens" in record:
            return record
    return None


def probe_tables(run: Path) -> list[str]:
    """The GLUE probe tables of every `glue_eval/*/results.json` of the run (a file that does not parse is left
    out, with a warning)."""
    tables = []
    for path in sorted(run.glob("glue_eval/*/results.json")):
        try:
            tables.append(f"`{path.parent.name}`:\n\n```\n{format_table(json.loads(path.read_text()))}\n```")
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning(f"model card: {path} left out ({type(e).__name__}: {e})")
    return tables


USAGE = """## Usage

```python
from transformers import AutoModel, AutoTokenizer
folder = "path/to/this/folder"  # or its id on the hub
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # the flag spares a prompt for config.json
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
batch = tokenizer(["a sentence", "another one"], padding=True, truncation=True, return_tensors="pt")
output = model(**batch)
output.last_hidden_state  # [2, tokens, dim], after the final norm
output.pooler_output  # [2, dim], unit rows: the sentence embeddings
```

```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/this/folder", trust_remote_code=True)
embeddings = model.encode(["a sentence", "another one"])  # [2, dim], unit rows
```
"""


def model_card(checkpoint: Path, params: dict, embedder: Embedder, pooler, config: dict) -> str:
    run = run_folder(checkpoint)
    probes = probe_tables(run) or ["No `glue_eval/*/results.json` next to the run."]
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: sentence-similarity",
        "tags: [sentence-transformers, feature-extraction, lingua]", "---", "",
        f"# {embedder.name}", "",
        f"A text encoder trained with Lingua (app `{params['app']}`), exported from `{checkpoint}` by "
        "`python -m lingua.export`.", "",
        "| | |", "|---|---|", *card_rows(run, params["config"], embedder, pooler, config), "",
        "## Frozen GLUE probes", "", *probes, "", USAGE])


def card_rows(run: Path, train: dict, embedder: Embedder, pooler, config: dict) -> list[str]:
    """The model card's table: shape, size, vocabulary, input, training and pooling."""
    encoder_params = sum(p.numel() for p in embedder.model.backbone.parameters())
    pooler_params = sum(p.numel() for p in pooler.parameters()) if pooler is not None else 0
    metrics = last_metrics(run)
    trained = f"{train.get('steps')} steps" + (
        f"; metrics.jsonl's last record: step {metrics.get('step')}, {metrics['data_tokens']:,} data tokens"
        if metrics else "")
    pooling = ("mean of the final states over the real tokens, L2-normalised" if pooler is None else
               f"attention pooler: a learned query, {config['pooler_num_layers']} cross-attention block(s) of "
               f"{config['pooler_num_attention_heads']} heads and an RMSNorm, L2-normalised")
    return [
        f"| shape | dim {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads of {config['head_dim']}, SwiGLU {config['intermediate_size']}, "
        f"RMSNorm eps {config['rms_norm_eps']}, RoPE theta {config['rope_theta']}, "
        f"scale_embeddings {config['scale_embeddings']} |",
        f"| parameters | {encoder_params:,} encoder" + (f" + {pooler_params:,} pooler" if pooler_params else "")
        + " |",
        f"| vocabulary | {config['vocab_size']:,} ids ({train['data']['tokenizer']['name']}), "
        f"`<s>` {config['bos_token_id']}, `</s>` {config['eos_token_id']}, `<pad>` {config['pad_token_id']}, "
        f"`<mask>` {config['mask_token_id']} |",
        f"| input | `<s> text </s>`, at most {embedder.max_len} tokens (the position table holds "
        f"{config['max_position_embeddings']}) |",
        f"| training | {trained}; sequences of {train['data'].get('seq_len')} tokens, batches of "
        f"{train['data'].get('batch_size')} per process |",
        *([f"| started from | `{train['init_from']}` |"] if train.get("init_from") else []),
        f"| pooling | {pooling} |",
    ]


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(ExportArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        print(f"wrote {export(args)}")


if __name__ == "__main__":
    main()
