"""The export's model card (README.md): the run's shape, size, vocabulary, input, training, pooling and heads, its
frozen GLUE probe tables, and how to load the folder: prose about the run (its metrics.jsonl and glue_eval
results) for readers, beside the files the libraries load (lingua/export/hf_folder.py).
"""

import logging
from pathlib import Path

from lingua.app import MaskedLMHead
from lingua.errors import UserError
from lingua.eval.report import format_table
from lingua.export.embedder import Embedder
from lingua.files import untrusted
from lingua.metrics import read_metrics
from lingua.run_folder import RunFolder

logger = logging.getLogger(__name__)


def last_metrics(run: RunFolder) -> dict | None:
    """The last record of the run's metrics.jsonl that counts data tokens (a line that does not parse is skipped);
    None, with a warning, if the file cannot be read."""
    try:
        records = read_metrics(run.metrics)
    except UserError as e:
        logger.warning(f"model card: no training metrics ({e})")
        return None
    return next((record for record in reversed(records) if "data_tokens" in record), None)


def probe_tables(run: RunFolder) -> list[str]:
    """The GLUE probe tables of every `glue_eval/*/results.json` of the run (a file that does not parse is left
    out, with a warning)."""
    tables = []
    for path in run.evaluation_results("glue"):
        try:
            table = format_table(untrusted.read_json(path, "GLUE results"))
            tables.append(f"`{path.parent.name}`:\n\n```\n{table}\n```")
        except (UserError, KeyError, TypeError) as e:
            logger.warning(f"model card: {path} left out ({type(e).__name__}: {e})")
    return tables


USAGE = """## Usage

```python
from transformers import AutoModel, AutoTokenizer
folder = "path/to/this/folder"  # or its id on the hub
# tokenizer.json runs no code; trust_remote_code=False spares transformers' question about config.json's code
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
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

CLASSIFIER_VECTORS = {"mean": "the mean of the final states over the real tokens", "first": "the state of `<s>`",
                      "attention": "the attention pooler's vector"}


def heads_usage(config: dict) -> str:
    """The model card's snippet for the task heads that config.json names."""
    fine_tuned = "id2label" in config
    lines = ["```python", "from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification"
             + (", pipeline" if config["masked_lm"] != "none" else ""),
             'folder = "path/to/this/folder"',
             "classifier = AutoModelForSequenceClassification.from_pretrained(folder, "
             + ("trust_remote_code=True)  # the fine-tuned head" if fine_tuned else
                "num_labels=3, trust_remote_code=True)  # a fresh head"),
             "tagger = AutoModelForTokenClassification.from_pretrained(folder, num_labels=9, trust_remote_code=True)"]
    if config["masked_lm"] != "none":
        lines += ['fill_mask = pipeline("fill-mask", model=folder, trust_remote_code=True)',
                  'fill_mask("The cat sat on the <mask>.")  # in this export, <mask> written in a text is the mask']
    return "\n".join([*lines, "```", ""])


READS = {  # what the tied output head reads, for each MaskedLMHead.reads
    "encoder": "the output head tied to the token embedding, on the final states",
    "cross_attention": "{layers} cross-attention block(s) reading the tokens other than `<mask>`, then the output head "
                       "tied to the token embedding",
    "self_attention": "{layers} self-attention block(s) over the input's token embeddings, then the output head tied "
                      "to the token embedding",
}


def heads_row(config: dict, masked_lm: MaskedLMHead | None) -> str:
    vector = f"{CLASSIFIER_VECTORS[config['classifier_pooling']]}, not normalised"
    if "id2label" in config:
        labels = ("a regression score" if config["problem_type"] == "regression" else
                  ", ".join(f"`{name}`" for name in config["id2label"].values()))
        classifier = f"the fine-tuned linear head ({labels}) on {vector}"
    else:
        classifier = f"a fresh linear head on {vector}"
    predicts = ("none (this run predicts no token)" if masked_lm is None else
                f"{masked_lm.description}: {READS[masked_lm.reads].format(layers=config.get('mlm_num_layers'))}")
    return f"| heads | sequence classification: {classifier}; token classification: a fresh linear head; " \
           f"masked LM: {predicts} |"


def model_card(checkpoint: Path, params: dict, embedder: Embedder, pooler, masked_lm: MaskedLMHead | None,
               config: dict) -> str:
    run = RunFolder.of(checkpoint)
    probes = probe_tables(run) or ["No `glue_eval/*/results.json` next to the run."]
    return "\n".join([
        "---", "library_name: transformers",
        f"pipeline_tag: {'text-classification' if 'id2label' in config else 'sentence-similarity'}",
        "tags: [sentence-transformers, feature-extraction, lingua]", "---", "",
        f"# {embedder.name}", "",
        f"A text encoder trained with Lingua (app `{params['app']}`), exported from `{checkpoint}` by "
        "`python -m lingua.export`.", "",
        "| | |", "|---|---|", *card_rows(run, params["config"], embedder, pooler, masked_lm, config), "",
        "## Frozen GLUE probes", "", *probes, "", USAGE, heads_usage(config)])


def card_rows(run: RunFolder, train: dict, embedder: Embedder, pooler, masked_lm: MaskedLMHead | None,
              config: dict) -> list[str]:
    """The model card's table: shape, size, vocabulary, input, training, pooling and heads."""
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
        heads_row(config, masked_lm),
    ]
