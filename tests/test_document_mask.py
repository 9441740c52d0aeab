"""data.document_mask: in a packed row each token attends only to its own document, in BERT, in ELECTRA's generator
and discriminator and in CrossBERT's encoder and predictor (each CMS view apart too). Changing one document changes
neither the outputs nor the gradients of another; without the flag it does; the document ids are read from the rows
as packed; the flex backend's block mask skips the blocks no query attends; a run trains with it."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_argv

from apps.crossbert.train import APP as CROSSBERT
from apps.electra import model as electra_model
from lingua.app import TEXT, build_model, load_app
from lingua.args import load_config
from lingua.data.loader import DataArgs, document_ids
from lingua.data.tokenizer import R50K_FILENAME, TokenizerArgs, build_tokenizer, default_tokenizer_dir
from lingua.errors import UserError
from lingua.model.transformer import ATTN_BACKENDS, document_mask
from lingua.train import train

VOCAB, BOS, MASK = 64, 60, 63  # text ids are 0..59
TINY = ["encoder.dim=32", "encoder.n_layers=2", "encoder.n_heads=4", "encoder.max_seqlen=256"]
VARIANTS = {"bert": ("bert", []), "electra": ("electra", []), "crossbert": ("crossbert", []),
            "crossbert, dense view mask": ("crossbert", ["cms_attention=mask"]),
            "crossbert, ratio 0.65": ("crossbert", ["mask_ratio=0.65"]),
            "crossbert, no CMS": ("crossbert", ["cms=false"])}
STARTS = {0: (7, 16), 1: (0, 12)}  # where each row's documents start: row 0 opens in the middle of a document


def tiny_model(variant: str, documents: bool = True, overrides: tuple[str, ...] = ()):
    name, extra = VARIANTS[variant]
    app = load_app(name)
    model = build_model(app.build_model, load_config(app.model_args_cls, [*TINY, *extra, *overrides]),
                        SimpleNamespace(vocab_size=VOCAB, mask_id=MASK), torch.device("cpu"), seed=0)
    model.separate_documents(BOS if documents else None)
    return model


def packed_rows(seq_len: int = 24, seed: int = 0) -> torch.Tensor:
    rows = torch.randint(0, BOS, (len(STARTS), seq_len), generator=torch.Generator().manual_seed(seed))
    for row, starts in STARTS.items():
        rows[row, list(starts)] = BOS
    return rows


def with_document_changed(rows: torch.Tensor, document: int) -> torch.Tensor:
    """rows with every text token of `document` (in each row) replaced by another text token."""
    inside = (document_ids(rows, BOS) == document) & (rows != BOS)
    return torch.where(inside, (rows + 1) % BOS, rows)


def outputs_and_embeddings(model, rows: torch.Tensor):
    """One training forward of `rows` (the real `forward`, masking seed 0): the states each network computes, each
    with the row position of every one of its tokens ([B, P, D], [B, P]), and the token embeddings entering them
    (gradients retained), likewise."""
    batch = model.make_batch(rows, torch.Generator().manual_seed(0))
    everywhere = torch.arange(rows.shape[1]).expand_as(rows)
    if "query_positions" in batch:  # CrossBERT: the encoder's tokens at `positions`, its predictor's queries
        networks = {model.encoder: batch["positions"], model.predictor: batch["query_positions"]}
        embedded_at = [batch["positions"]]
    else:  # BERT's encoder; ELECTRA's generator, then its discriminator: each embeds the whole row
        networks = {getattr(model, name): everywhere for name in ("encoder", "generator", "discriminator")
                    if hasattr(model, name)}
        embedded_at = [everywhere] * (2 if hasattr(model, "generator") else 1)
    states, embeddings = [], []
    hooks = [network.register_forward_hook(lambda module, args, out, at=at: states.append((out, at)))
             for network, at in networks.items()]
    hooks.append(model.backbone.tok_embeddings.register_forward_hook(
        lambda module, args, out: embeddings.append(out) or out.retain_grad()))
    model(**batch)
    for hook in hooks:
        hook.remove()
    return states, list(zip(embeddings, embedded_at))


def gradients_of_document(states, embeddings, documents: torch.Tensor, document: int) -> list[torch.Tensor]:
    """The gradient of `document`'s states (a fixed projection of them) with respect to every token embedding."""
    for embedded, _ in embeddings:
        embedded.grad = None
    projection = torch.linspace(-1, 1, states[0][0].shape[-1])
    total = sum((out @ projection)[documents.gather(1, at) == document].sum() for out, at in states)
    total.backward(retain_graph=True)
    return [embedded.grad for embedded, _ in embeddings]


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_one_document_changes_neither_the_outputs_nor_the_gradients_of_another(variant):
    model, rows = tiny_model(variant), packed_rows()
    changed = with_document_changed(rows, 1)
    documents = document_ids(rows, BOS)
    (states, embeddings), (states_after, embeddings_after) = (outputs_and_embeddings(model, x) for x in (rows, changed))
    for (out, at), (out_after, _) in zip(states, states_after):
        others, own = documents.gather(1, at) != 1, documents.gather(1, at) == 1
        assert torch.equal(out_after[others], out[others])
        assert not torch.allclose(out_after[own], out[own])
    for document in (0, 2):
        grads = gradients_of_document(states, embeddings, documents, document)
        grads_after = gradients_of_document(states_after, embeddings_after, documents, document)
        for grad, grad_after, (_, at) in zip(grads, grads_after, embeddings):
            assert torch.equal(grad_after, grad)  # the same gradients, whatever document 1 holds
            outside = documents.gather(1, at) != document
            assert torch.equal(grad[outside], torch.zeros_like(grad[outside]))  # none reaches another document
            assert grad[~outside].abs().sum() > 0


@pytest.mark.parametrize("variant", ["bert", "electra", "crossbert", "crossbert, no CMS"])
def test_without_the_flag_the_batch_is_as_before_and_a_token_sees_the_other_documents(variant):
    model, rows = tiny_model(variant, documents=False), packed_rows()
    batch = model.make_batch(rows, torch.Generator().manual_seed(0))
    assert "document_ids" not in batch  # forward takes the path it took before the flag existed
    documents = document_ids(rows, BOS)
    states, _ = outputs_and_embeddings(model, rows)
    states_after, _ = outputs_and_embeddings(model, with_document_changed(rows, 1))
    for (out, at), (out_after, _) in zip(states, states_after):
        others = documents.gather(1, at) != 1
        assert not torch.allclose(out_after[others], out[others])


def test_document_ids_count_the_documents_started_along_each_row():
    assert document_ids(packed_rows(), BOS).tolist() == [[0] * 7 + [1] * 9 + [2] * 8, [1] * 12 + [2] * 12]
    tokenizer = build_tokenizer(TokenizerArgs(name="bytes"))
    assert TEXT.document_start(DataArgs(document_mask=True), tokenizer) == tokenizer.bos_id
    assert TEXT.document_start(DataArgs(), tokenizer) is None


@pytest.mark.parametrize("variant", ["bert", "electra"])
def test_the_document_ids_are_those_of_the_rows_as_packed_even_where_a_start_is_masked(variant):
    model, rows = tiny_model(variant), packed_rows()
    batches = (model.make_batch(rows, torch.Generator().manual_seed(seed)) for seed in range(100))
    batch = next(b for b in batches if (b["inputs"][0, list(STARTS[0])] == MASK).any())  # a <s> is masked
    assert torch.equal(batch["document_ids"], document_ids(rows, BOS))
    assert not torch.equal(document_ids(batch["inputs"], BOS), batch["document_ids"])


def test_electras_discriminator_keeps_the_documents_of_the_original_rows_when_a_start_is_sampled(monkeypatch):
    model, rows = tiny_model("electra"), packed_rows()
    batch = model.make_batch(rows, torch.Generator().manual_seed(0))
    monkeypatch.setattr(electra_model, "sample_replacements",  # the generator samples <s> at every masked position
                        lambda logits, uniforms: torch.full_like(uniforms, BOS, dtype=torch.long))
    seen = []
    model.discriminator.register_forward_pre_hook(lambda module, args: seen.append(args))
    model(**batch)
    corrupted, _, mask = seen[0]
    assert (corrupted == BOS).sum() > (rows == BOS).sum()  # the sampled <s> are in its input
    assert torch.equal(mask.q_ids, document_ids(rows, BOS)) and torch.equal(mask.kv_ids, mask.q_ids)


def test_a_query_whose_document_shows_no_token_in_its_view_gets_a_finite_prediction():
    """A one-token document (the <s> ending a row) is masked in one CMS view: that view's query attends to nothing
    (sdpa's and flex's output for a row with no key allowed is zero) and is predicted from its position alone."""
    model, rows = tiny_model("crossbert"), packed_rows()
    rows[:, -1] = BOS
    loss, _ = model(**model.make_batch(rows, torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_an_app_that_cannot_separate_documents_refuses_the_flag(monkeypatch):
    model = tiny_model("bert", documents=False)
    monkeypatch.setattr(model, "masks_documents", False)
    with pytest.raises(UserError, match="data.document_mask: Bert cannot keep tokens to their own document"):
        model.separate_documents(BOS)


def test_gpt2_and_bytes_never_encode_text_as_a_document_start():
    texts = ["<s> a </s>", "<|endoftext|>", bytes(range(128)).decode(), "Ünïcödé 🙂"]
    tokenizers = [build_tokenizer(TokenizerArgs(name="bytes"))]
    if (default_tokenizer_dir() / R50K_FILENAME).exists():
        tokenizers.append(build_tokenizer(TokenizerArgs(name="gpt2")))
    for tokenizer in tokenizers:
        assert all(max(tokenizer.encode(text)) < tokenizer.bos_id for text in texts)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_skips_the_blocks_of_other_views_and_documents_and_computes_what_sdpa_does():
    """Flex has no backward on the CPU in this torch: its block mask and forward are checked here, its training on a
    GPU by scripts/gpu_acceptance.sh."""
    seq_len = 256  # two views of 128 tokens: flex's blocks are 128 x 128
    rows = packed_rows(seq_len)
    rows[0, 200] = BOS  # row 0: documents of 7, 9, 184 and 56 tokens
    sdpa, flex = tiny_model("crossbert"), tiny_model("crossbert", overrides=("encoder.attn_backend=flex",))
    flex.load_state_dict(sdpa.state_dict())
    batch = sdpa.make_batch(rows, torch.Generator().manual_seed(0))
    encoder_mask, predictor_mask = sdpa.attention_masks(batch["positions"], batch["query_positions"],
                                                        batch["document_ids"])
    for mask in (encoder_mask, predictor_mask):
        blocks = ATTN_BACKENDS["flex"].bias(mask, 4).to_dense()[:, 0]  # [B, query blocks, key blocks]
        allowed = mask.q_ids[:, :, None] == mask.kv_ids[:, None, :]
        assert torch.equal(blocks.bool(), allowed.unflatten(1, (2, 128)).unflatten(3, (2, 128)).any(4).any(2))
        assert not blocks[:, 0, 1].any() and not blocks[:, 1, 0].any()  # view A's and view B's blocks: skipped
    rows[1, 128] = BOS  # row 1: documents of 12, 116 and 128 tokens, the last one a block of its own
    blocks = ATTN_BACKENDS["flex"].bias(document_mask(document_ids(rows, BOS)), 4).to_dense()[1, 0]
    assert blocks.tolist() == [[1, 0], [0, 1]]
    with torch.no_grad():
        expected, got = (model.predict(*(batch[k] for k in ("inputs", "positions", "query_positions",
                                                            "document_ids"))) for model in (sdpa, flex))
    assert torch.allclose(got, expected, atol=1e-5)


def test_a_run_with_document_masks_trains(corpus, tmp_path):
    argv = tiny_argv(corpus, tmp_path / "run", 4) + ["data.document_mask=true", "validation.every=4"]
    summary = train(CROSSBERT, load_config(CROSSBERT.args_cls, argv))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r] + [r["val/loss"] for r in records if "val/loss" in r]
    assert summary["steps"] == 4 and len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
