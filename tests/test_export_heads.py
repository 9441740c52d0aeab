"""The export's task heads (lingua/export/hf_folder.py): transformers' AutoModelForSequenceClassification reads our
pooled vectors (a fine-tuning run's head gives its logits), AutoModelForTokenClassification our states,
AutoModelForMaskedLM gives our masked-LM logits (BERT's tied head, CrossBERT's predictor, ELECTRA's generator) and
the fill-mask pipeline their softmax; a run that predicts no token claims no masked-LM head. Tiny models with every
weight moved off its init, built in place (no training)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from apps.bert.train import APP as BERT
from apps.contrastive.train import APP as CONTRASTIVE
from apps.crossbert.train import APP as CROSSBERT
from apps.electra.train import APP as ELECTRA
from apps.finetune.train import APP as FINETUNE
from lingua.app import MASKED_LM_READS, MaskedLMHead, build_from_params
from lingua.args import load_config, to_dict
from lingua.checkpoint.store import save_consolidated
from lingua.errors import UserError
from lingua.eval.features import encode_example, mean_pool, pad_batch
from lingua.eval.glue_data import TASKS
from lingua.export.hf_folder import TEMPLATE_DIR, ExportArgs, export
from lingua.model.transformer import default_positions

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat", "a dog", "the big red house by the river", "héllo wörld"]
SHAPE = ["data.tokenizer.name=bytes", "data.seq_len=32", "model.encoder.dim=32", "model.encoder.n_layers=2",
         "model.encoder.n_heads=2", "model.encoder.max_seqlen=48"]
MODELS = {  # app, its settings: an output bias, a predictor narrower than the encoder, a generator of its own heads
    "bert": (BERT, ["model.encoder.output_bias=true"]),
    "crossbert": (CROSSBERT, ["model.encoder.output_bias=true", "model.predictor.dim=16", "model.predictor.n_heads=2",
                              "model.predictor.rope_theta=500"]),
    "electra": (ELECTRA, ["model.generator.n_layers=1", "model.generator.n_heads=4"]),
    "contrastive": (CONTRASTIVE, ["model.pooler.n_layers=2"]),
}


def tiny_checkpoint(app, run: Path, settings: list[str], seed: int = 0) -> tuple[torch.nn.Module, object, Path]:
    """A tiny model of the app (eval mode) with every weight moved off its init, its tokenizer and checkpoint."""
    params = {"app": app.name, "config": to_dict(load_config(app.args_cls, [f"dump_dir={run}", *SHAPE, *settings]))}
    model, _, tokenizer = build_from_params(params)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval(), tokenizer, save_consolidated(model, params, run / "consolidated.pt")


def export_to(out: Path, checkpoint: Path, **options) -> Path:
    return export(ExportArgs(ckpt=str(checkpoint), out=str(out), **options))


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object, Path]]:
    """Each kind's model (eval mode), tokenizer and export folder."""
    root = tmp_path_factory.mktemp("heads")
    made = {}
    for seed, (kind, (app, settings)) in enumerate(MODELS.items()):
        model, tokenizer, checkpoint = tiny_checkpoint(app, root / kind, settings, seed)
        made[kind] = model, tokenizer, export_to(root / f"{kind}_hf", checkpoint)
    return made


def load(auto_class, folder: Path, **kwargs):
    model, loading = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True,
                                                                       output_loading_info=True, **kwargs)
    return model.eval(), loading


def hf_batch(folder: Path, texts: list[str]) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our token rows `<s> text </s>` and their pad mask."""
    return pad_batch([encode_example(tokenizer, (text,), 32) for text in texts], tokenizer.pad_id, torch.device("cpu"))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def attention_pooled(pooler, hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """Our attention pooler's vector before the L2 normalisation: its final norm's output at the query."""
    captured = []
    handle = pooler.norm.register_forward_hook(lambda module, args, output: captured.append(output))
    pooler(hidden, pad_mask)
    handle.remove()
    return captured[0][:, 0].float()


@pytest.mark.parametrize("kind, pooling", [("bert", None), ("crossbert", "first"), ("contrastive", None),
                                           ("contrastive", "mean")])
def test_sequence_classification_reads_our_pooled_vector(exports, kind, pooling):
    """A fresh head on the mean (a pre-training run's default), the first token's state, or the attention pooler's
    vector (a contrastive run's default), none of them normalised; transformers' losses."""
    model, _, folder = exports[kind]
    options = {"num_labels": 3, **({"classifier_pooling": pooling} if pooling else {})}
    classifier, loading = load("AutoModelForSequenceClassification", folder, **options)
    assert loading["missing_keys"] == {"classifier.weight", "classifier.bias"} and not loading["unexpected_keys"]
    tokens, pad_mask = padded(exports[kind][1], TEXTS)
    with torch.no_grad():
        output = classifier(input_ids=tokens, attention_mask=pad_mask.long(), labels=torch.tensor([0, 2, 1, 2]))
        hidden = model.encode(tokens, pad_mask)
        pooled = {"mean": mean_pool(hidden, pad_mask), "first": hidden[:, 0].float(),
                  "attention": attention_pooled(model.pooler, hidden, pad_mask) if kind == "contrastive" else None}
        expected = classifier.classifier(pooled[pooling or ("attention" if kind == "contrastive" else "mean")])
    close(output.logits, expected)
    close(output.loss, F.cross_entropy(expected, torch.tensor([0, 2, 1, 2])))

    regression, _ = load("AutoModelForSequenceClassification", folder, num_labels=1)
    with torch.no_grad():
        output = regression(input_ids=tokens, attention_mask=pad_mask.long(), labels=torch.ones(4))
    close(output.loss, F.mse_loss(output.logits.squeeze(-1), torch.ones(4)))


@pytest.mark.parametrize("pooling, task, num_labels", [("mean", "sst2", 2), ("first", "stsb", 1),
                                                       ("attention", "mnli", 3)])
def test_a_fine_tuned_head_gives_our_logits(tmp_path, pooling, task, num_labels):
    model, tokenizer, checkpoint = tiny_checkpoint(FINETUNE, tmp_path / "run", [
        f"model.pooling={pooling}", f"model.num_labels={num_labels}", f"data.task={task}"])
    folder = export_to(tmp_path / "hf", checkpoint)
    classifier, loading = load("AutoModelForSequenceClassification", folder)
    assert not any(loading.values()), loading
    assert list(classifier.config.id2label.values()) == (list(TASKS[task].labels) or ["LABEL_0"])
    assert classifier.config.problem_type == ("regression" if num_labels == 1 else "single_label_classification")
    tokens, pad_mask = padded(tokenizer, TEXTS)
    with torch.no_grad():
        close(classifier(input_ids=tokens, attention_mask=pad_mask.long()).logits, model.logits(tokens))
    assert "AutoModelForMaskedLM" not in json.loads((folder / "config.json").read_text())["auto_map"]
    assert "the fine-tuned linear head" in (folder / "README.md").read_text()


def test_a_fine_tuned_attention_head_keeps_its_pooler(tmp_path):
    _, _, checkpoint = tiny_checkpoint(FINETUNE, tmp_path / "run", ["model.pooling=attention"])
    with pytest.raises(UserError, match="the attention pooler that this run's classifier reads"):
        export_to(tmp_path / "hf", checkpoint, pooling="mean")


def test_attention_classifier_pooling_needs_the_pooler(exports):
    with pytest.raises(ValueError, match="classifier_pooling='attention' reads the attention pooler"):
        load("AutoModelForSequenceClassification", exports["bert"][2], classifier_pooling="attention")


def test_token_classification_reads_our_states(exports):
    model, tokenizer, folder = exports["electra"]
    classifier, loading = load("AutoModelForTokenClassification", folder, num_labels=5)
    assert loading["missing_keys"] == {"token_classifier.weight", "token_classifier.bias"}
    tokens, pad_mask = padded(tokenizer, TEXTS)
    labels = torch.where(pad_mask, tokens % 5, -100)
    with torch.no_grad():
        output = classifier(input_ids=tokens, attention_mask=pad_mask.long(), labels=labels)
        expected = classifier.token_classifier(model.encode(tokens, pad_mask))
    close(output.logits, expected)
    close(output.loss, F.cross_entropy(expected[pad_mask], labels[pad_mask]))


def masked_batch(folder: Path, mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded rows with a different number of <mask> tokens each: tokens, pad mask, mask positions."""
    batch = hf_batch(folder, TEXTS)
    tokens, real = batch["input_ids"], batch["attention_mask"].bool()
    masked = torch.zeros_like(real)
    for row, positions in enumerate([[2, 3, 7], [1], [4, 5, 6, 9, 12], [3, 8]]):
        masked[row, positions] = True
    return tokens.masked_fill(masked, mask_id), real, masked


def our_masked_lm_logits(kind: str, model, tokens: torch.Tensor, real: torch.Tensor,
                         masked: torch.Tensor) -> list[torch.Tensor]:
    """Per row, our logits [masks, vocab] at its <mask> positions, each row on its own (no padding)."""
    rows = []
    for row_tokens, row_real, row_masked in zip(tokens, real, masked):
        row = row_tokens[row_real][None]
        if kind == "bert":
            logits = model.encoder.logits(model.encoder(row, default_positions(row)))[0]
        elif kind == "electra":
            hidden = model.generator(model.discriminator.embed(row), default_positions(row))
            logits = F.linear(hidden, model.discriminator.tok_embeddings.weight)[0]
        else:  # the predictor's queries at the masks read the encoder over the visible tokens, as in training
            positions = torch.arange(row.shape[1])
            visible, queries = positions[~row_masked[row_real]][None], positions[row_masked[row_real]][None]
            hidden = model.encoder(row.gather(1, visible), visible)
            rows.append(model.encoder.logits(model.predictor(hidden, visible, queries, None))[0])
            continue
        rows.append(logits[row_masked[row_real]])
    return rows


@pytest.mark.parametrize("kind", ["bert", "crossbert", "electra"])
def test_masked_lm_gives_our_logits_at_the_masks(exports, kind):
    model, tokenizer, folder = exports[kind]
    masked_lm, loading = load("AutoModelForMaskedLM", folder)
    assert not any(loading.values()), loading
    config = json.loads((folder / "config.json").read_text())
    assert config["masked_lm"] == {"bert": "encoder", "crossbert": "cross_attention", "electra": "self_attention"}[kind]
    assert f"masked LM: {model.masked_lm.description}: " in (folder / "README.md").read_text()  # the app's words
    tokens, real, masked = masked_batch(folder, tokenizer.mask_id)
    labels = torch.where(masked, tokens, -100)
    with torch.no_grad():
        output = masked_lm(input_ids=tokens, attention_mask=real.long(), labels=labels)
        ours = our_masked_lm_logits(kind, model, tokens, real, masked)
    for row in range(len(TEXTS)):
        close(output.logits[row][masked[row]], ours[row])
    assert torch.isfinite(output.logits[real]).all() and torch.isfinite(output.loss)


@pytest.mark.parametrize("kind", ["bert", "crossbert"])
def test_fill_mask_pipeline_scores_are_our_softmax(exports, kind):
    model, tokenizer, folder = exports[kind]
    fill_mask = transformers.pipeline("fill-mask", model=str(folder), trust_remote_code=True, device="cpu")
    results = fill_mask("the cat <mask>at on the mat", top_k=5)
    tokens = torch.tensor([[tokenizer.bos_id, *tokenizer.encode("the cat "), tokenizer.mask_id,
                            *tokenizer.encode("at on the mat"), tokenizer.eos_id]])
    with torch.no_grad():
        logits = our_masked_lm_logits(kind, model, tokens, torch.ones_like(tokens, dtype=torch.bool),
                                      tokens == tokenizer.mask_id)[0][0]
    scores, ids = logits.softmax(-1).topk(5)
    assert [result["token"] for result in results] == ids.tolist()
    close(torch.tensor([result["score"] for result in results]), scores)


def test_a_masked_lm_head_reads_what_the_export_computes():
    """An app's declared head reads one of the states the export's template computes, through a network it names
    exactly when it has one."""
    spec = importlib.util.spec_from_file_location("configuration_lingua", TEMPLATE_DIR / "configuration_lingua.py")
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)
    assert template.MASKED_LMS == ("none", *MASKED_LM_READS)
    for reads, network in [("decoder", "decoder"), ("cross_attention", ""), ("encoder", "encoder")]:
        with pytest.raises(ValueError, match="MaskedLMHead"):
            MaskedLMHead(reads, "a head", network=network)


def test_a_contrastive_export_has_no_masked_lm(exports):
    folder = exports["contrastive"][2]
    config = json.loads((folder / "config.json").read_text())
    assert config["masked_lm"] == "none" and "AutoModelForMaskedLM" not in config["auto_map"]
    assert "AutoModelForTokenClassification" in config["auto_map"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["split_special_tokens"]  # "<mask>" is text
    with pytest.raises(ValueError, match="AutoModelForMaskedLM"):
        transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    masked_lm_class = get_class_from_dynamic_module("modeling_lingua.LinguaForMaskedLM", str(folder))
    with pytest.raises(ValueError, match="this export has no masked-LM head"):
        masked_lm_class.from_pretrained(folder)


def test_a_masked_lm_export_parses_the_mask_token(exports):
    tokenizer, folder = exports["bert"][1:]
    ids = hf_batch(folder, ["a <mask> b"])["input_ids"][0].tolist()
    assert ids == [tokenizer.bos_id, *tokenizer.encode("a "), tokenizer.mask_id, *tokenizer.encode(" b"),
                   tokenizer.eos_id]
