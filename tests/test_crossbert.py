"""CrossBERT: the split, no leakage between views or from masked tokens, the cross-attention-only predictor, CMS,
compilation, parameter and FLOPs accounting against the paper, and end-to-end training."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import read_metrics, tiny_argv

from apps.crossbert.model import CrossBert, CrossBertArgs, PredictorArgs, predictor_flops_per_token, view_ids
from apps.crossbert.train import APP
from lingua.app import load_model
from lingua.args import load_config
from lingua.errors import UserError
from lingua.model.flops import count_params, encoder_flops_per_token, non_embedding_params
from lingua.model.transformer import Segments, TransformerArgs
from lingua.train import train

REPO = Path(__file__).resolve().parents[1]
TINY = TransformerArgs(dim=32, n_layers=4, n_heads=4, max_seqlen=64)
VOCAB, B, S = 50, 3, 24


def build(mask_ratio=0.5, cms=True, predictor=None, vocab=VOCAB, cms_attention="segments") -> CrossBert:
    args = CrossBertArgs(encoder=TINY, predictor=predictor or PredictorArgs(), mask_ratio=mask_ratio, cms=cms,
                         cms_attention=cms_attention)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CrossBert(args, vocab)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def split(model, tokens, seed=0):
    return model.make_batch(tokens, torch.Generator().manual_seed(seed))


def tokens(seed=0):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def views(ratio):
    """Which view (0: A, 1: B) each position of a CMS encoder row and of a predictor row belongs to."""
    n_masked = round(ratio * S)
    return view_ids((S - n_masked, n_masked), "cpu")[0], view_ids((n_masked, S - n_masked), "cpu")[0]


def sorted_rows(x):
    return x.sort(1).values


@pytest.mark.parametrize("ratio", [0.5, 0.65, 0.15])
def test_split_sizes_disjoint_and_complete(ratio):
    batch = split(build(ratio, cms=False), tokens())
    n_masked = round(ratio * S)
    assert batch["query_positions"].shape == (B, n_masked)
    assert batch["positions"].shape == batch["inputs"].shape == (B, S - n_masked)
    everything = torch.cat([batch["positions"], batch["query_positions"]], 1)
    assert torch.equal(sorted_rows(everything), torch.arange(S).expand(B, -1))  # disjoint, union = all


def test_split_is_random_across_rows_and_steps_and_reproducible():
    model, x = build(cms=False), tokens()
    generator = torch.Generator().manual_seed(7)
    first, second = (model.make_batch(x, generator)["query_positions"] for _ in range(2))
    assert not torch.equal(first, second)
    assert len({tuple(row.tolist()) for row in first}) == B
    assert torch.equal(first, model.make_batch(x, torch.Generator().manual_seed(7))["query_positions"])


def test_encoder_sees_only_visible_tokens_at_their_positions():
    x = tokens()
    batch = split(build(cms=False), x)
    assert torch.equal(batch["inputs"], x.gather(1, batch["positions"]))
    assert torch.equal(batch["targets"], x.gather(1, batch["query_positions"]))


@pytest.mark.parametrize("ratio", [0.5, 0.65])
def test_cms_packs_two_complementary_views_and_predicts_every_token_once(ratio):
    model, x = build(ratio), tokens()
    batch = split(model, x)
    n_masked = round(ratio * S)
    assert model.views_per_sequence == 2
    for key in ("inputs", "positions", "query_positions", "targets"):
        assert batch[key].shape == (B, S), key
    enc_view, q_view = views(ratio)
    assert enc_view.tolist() == [0] * (S - n_masked) + [1] * n_masked
    assert q_view.tolist() == [0] * n_masked + [1] * (S - n_masked)
    # Every position is predicted exactly once, with its own token as target.
    assert torch.equal(sorted_rows(batch["query_positions"]), torch.arange(S).expand(B, -1))
    assert torch.equal(batch["targets"], x.gather(1, batch["query_positions"]))
    # View B sees exactly what view A predicts, and predicts exactly what view A sees.
    pos, qpos = batch["positions"], batch["query_positions"]
    assert torch.equal(pos[:, enc_view == 1], qpos[:, q_view == 0])
    assert torch.equal(pos[:, enc_view == 0], qpos[:, q_view == 1])


def test_split_rejects_empty_views():
    with pytest.raises(UserError, match="mask_ratio 0.99 masks 24 of 24 tokens per sequence"):
        split(build(0.99), tokens())


# Pinned values of make_batch, view_masks and the FLOPs for TINY and VOCAB: (cms, mask_ratio,
# seq_len) -> (encoder row length, predictor row length, the CMS segments: encoder's, predictor's, F_N, head FLOPs),
# both per token-view.
LAYOUTS = {
    (False, 0.15, 24): (20, 4, None, None, 643430.4, 1440.0),
    (False, 0.15, 37): (31, 6, None, None, 661152.0, 1440.0),
    (False, 0.65, 24): (8, 16, None, None, 371558.4, 6240.0),
    (False, 0.65, 37): (13, 24, None, None, 381792.0, 6240.0),
    (True, 0.15, 24): (24, 24, (20, 4), (4, 20), 453120.0, 4800.0),
    (True, 0.5, 37): (37, 37, (19, 18), (18, 19), 465600.0, 4800.0),
    (True, 0.65, 24): (24, 24, (8, 16), (16, 8), 453120.0, 4800.0),
    (True, 0.65, 37): (37, 37, (13, 24), (24, 13), 465600.0, 4800.0),
}


@pytest.mark.parametrize("cms, ratio, seq_len", sorted(LAYOUTS))
def test_one_layout_gives_the_rows_the_view_masks_and_the_flops(cms, ratio, seq_len):
    encoder_len, query_len, encoder_views, query_views, flops, head_flops = LAYOUTS[cms, ratio, seq_len]
    model = build(ratio, cms)
    layout = model.args.layout(seq_len)
    assert len(layout.views) == model.views_per_sequence == (2 if cms else 1)
    assert (sum(layout.encoder_lengths), sum(layout.query_lengths)) == (encoder_len, query_len)
    batch = model.make_batch(torch.zeros(2, seq_len, dtype=torch.long), torch.Generator().manual_seed(0))
    assert batch["inputs"].shape == batch["positions"].shape == (2, encoder_len)
    assert batch["query_positions"].shape == batch["targets"].shape == (2, query_len)
    assert model.flops_per_token_view(seq_len) == pytest.approx(flops, rel=1e-12)
    assert model.head_flops_per_token_view(seq_len) == pytest.approx(head_flops, rel=1e-12)
    if cms:
        assert model.view_masks(2, seq_len) == (Segments(encoder_views, encoder_views),
                                                Segments(query_views, encoder_views))
        encoder_ids, query_ids = (view_ids(lengths, "cpu").expand(2, -1) for lengths in (encoder_views, query_views))
        encoder_mask, predictor_mask = build(ratio, cms, cms_attention="mask").view_masks(2, seq_len)
        for got, expected in ((encoder_mask.q_ids, encoder_ids), (encoder_mask.kv_ids, encoder_ids),
                              (predictor_mask.q_ids, query_ids), (predictor_mask.kv_ids, encoder_ids)):
            assert torch.equal(got, expected)


def predictions(model, batch):
    return model.predict(**{k: v for k, v in batch.items() if k != "targets"})


def replace_at(x, positions):
    """x with every token at `positions` [B, K] replaced by a different one."""
    return x.scatter(1, positions, (x.gather(1, positions) + 1) % VOCAB)


CMS_CASES = [(ratio, attention) for ratio in (0.5, 0.65) for attention in ("segments", "mask")]


@pytest.mark.parametrize("ratio,cms_attention", CMS_CASES)
def test_no_leakage_between_views_in_outputs(ratio, cms_attention):
    model, x = build(ratio, cms_attention=cms_attention), tokens()
    batch = split(model, x)
    q_view = views(ratio)[1]
    out = predictions(model, batch)
    for view in (0, 1):
        hidden = batch["query_positions"][:, q_view == view]  # what this view must predict
        seen = batch["query_positions"][:, q_view != view]  # = what this view's encoder tokens are
        same = predictions(model, split(model, replace_at(x, hidden)))
        assert torch.equal(same[:, q_view == view], out[:, q_view == view])
        changed = predictions(model, split(model, replace_at(x, seen[:, :1])))
        assert not torch.allclose(changed[:, q_view == view], out[:, q_view == view])


def test_no_leakage_without_cms():
    model, x = build(cms=False), tokens()
    batch = split(model, x)
    out = predictions(model, batch)
    assert torch.equal(predictions(model, split(model, replace_at(x, batch["query_positions"]))), out)
    assert not torch.allclose(predictions(model, split(model, replace_at(x, batch["positions"][:, :1]))), out)


@pytest.mark.parametrize("ratio,cms_attention", CMS_CASES)
def test_no_gradient_flows_from_a_views_loss_to_the_other_views_tokens(ratio, cms_attention):
    model = build(ratio, cms_attention=cms_attention)
    batch = split(model, tokens())
    embedded = []
    model.encoder.tok_embeddings.register_forward_hook(lambda mod, inp, out: embedded.append(out) or out.retain_grad())
    logits = model.encoder.logits(predictions(model, batch))
    enc_view, q_view = views(ratio)
    for view in (0, 1):
        model.zero_grad()
        picked = q_view == view
        F.cross_entropy(logits[:, picked].flatten(0, 1), batch["targets"][:, picked].flatten()).backward(
            retain_graph=True
        )
        grad = embedded[0].grad
        assert torch.equal(grad[:, enc_view != view], torch.zeros_like(grad[:, enc_view != view]))
        assert (grad[:, enc_view == view].abs().sum(-1) > 0).all()
        embedded[0].grad = None


@pytest.mark.parametrize("ratio", [0.5, 0.65])
def test_segmented_views_compute_what_the_dense_view_mask_computes(ratio):
    """Per-view attention (no mask) against the reference: both views in one attention with a dense view mask."""
    segmented, masked = build(ratio), build(ratio, cms_attention="mask")
    batch = split(segmented, tokens())
    losses = [model(**batch)[0] for model in (segmented, masked)]
    assert torch.allclose(predictions(segmented, batch), predictions(masked, batch), atol=1e-6)
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(segmented.named_parameters(), masked.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_predictor_queries_do_not_see_each_other():
    """Perturbing the mask embedding at one query changes that query's output only."""
    model = build()
    batch = split(model, tokens())
    reference = predictions(model, batch)
    query = 5

    def perturb(module, args):
        h = args[0].clone()
        h[:, query] += torch.randn(h.shape[-1])
        return (h, *args[1:])

    model.predictor.layers[0].register_forward_pre_hook(perturb)
    perturbed = predictions(model, batch)
    others = torch.arange(S) != query
    assert torch.equal(perturbed[:, others], reference[:, others])
    assert not torch.allclose(perturbed[:, query], reference[:, query])


def test_predictor_width_can_differ_from_the_encoders():
    model = build(predictor=PredictorArgs(n_layers=2, dim=16, n_heads=2))
    batch = split(model, tokens())
    assert predictions(model, batch).shape == (B, S, TINY.dim)
    loss, stats = model(**batch)
    loss.backward()
    assert torch.isfinite(loss) and 0 <= stats["accuracy"] <= 1
    matrices = sum(p.numel() for p in model.predictor.parameters() if p.ndim == 2)  # blocks and both projections
    expected = 6 * matrices + 12 * 16 * 2 * S
    assert predictor_flops_per_token(model.args.predictor_transformer(), TINY.dim, S) == expected


def test_predictor_defaults_follow_the_encoder():
    pred = CrossBertArgs(encoder=TransformerArgs(dim=768, n_layers=28, n_heads=12)).predictor_transformer()
    assert (pred.n_layers, pred.dim, pred.n_heads, pred.head_dim) == (7, 768, 12, None)
    assert CrossBertArgs(encoder=TransformerArgs(n_layers=2)).predictor_transformer().n_layers == 1
    assert pred.rope_theta == 10000.0


def test_the_predictor_may_take_its_own_rope_base():
    model = build(predictor=PredictorArgs(rope_theta=100.0))
    assert model.encoder.rope.theta == TINY.rope_theta and model.predictor.rope.theta == 100.0
    other = build(predictor=PredictorArgs(rope_theta=100.0 * 7))
    batch = split(model, tokens())
    other.load_state_dict(model.state_dict())
    assert not torch.allclose(predictions(model, batch), predictions(other, batch))  # the base reaches the queries


def test_loss_and_accuracy_cover_every_prediction():
    model = build()
    batch = split(model, tokens())
    loss, stats = model(**batch)
    logits = model.encoder.logits(predictions(model, batch))
    assert torch.allclose(loss, F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()))
    assert stats["accuracy"] == (logits.argmax(-1) == batch["targets"]).float().mean()


def test_encode_uses_the_full_sequence_and_ignores_padding():
    model, x = build(), tokens()
    out = model.encode(x)
    assert out.shape == (B, S, TINY.dim)
    layers = model.encode(x, all_layers=True)
    assert len(layers) == TINY.n_layers and torch.equal(layers[-1], out)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[:, -4:] = False
    padded = model.encode(x, pad)
    assert torch.allclose(padded[:, :-4], model.encode(x[:, :-4]), atol=1e-5)
    assert torch.equal(padded[:, :-4], model.encode(replace_at(x, torch.arange(S - 4, S).expand(B, -1)), pad)[:, :-4])


def test_flops_per_token_view_is_eq_8():
    for cms, ratio in ((False, 0.5), (False, 0.65), (True, 0.5), (True, 0.65)):
        model = build(ratio, cms)
        f_enc = encoder_flops_per_token(TINY, S)
        f_pred = encoder_flops_per_token(model.args.predictor_transformer(), S)
        if cms:  # each data token is encoded in one view and predicted in the other: two token-views
            assert 2 * model.flops_per_token_view(S) == pytest.approx(f_enc + f_pred)
        else:
            assert model.flops_per_token_view(S) == pytest.approx(f_enc * (1 - ratio) + f_pred * ratio)


# ---------------------------------------------------------------- the paper's configs

CONFIGS = REPO / "apps" / "crossbert" / "configs"
ROBERTA_VOCAB, OUR_VOCAB = 50265, 50261

# Appendix J, CrossBERT: ID: (Params M, FLOPs, enc dim, enc layers, enc heads, head dim, pred dim, pred layers,
# pred heads, steps, tokens B, BSZ, GPUs, grad acc, lr)
APPENDIX_J = {
    0: (61.80, 1.92e18, 640, 15, 10, 64, 640, 3, 10, 13745, 6.19, 450560, 1, 5, 4.51e-03),
    1: (93.62, 4.91e18, 768, 17, 12, 64, 768, 4, 12, 19749, 9.91, 501760, 1, 7, 3.47e-03),
    2: (138.58, 1.15e19, 896, 19, 14, 64, 896, 4, 14, 26978, 15.19, 563200, 1, 11, 2.73e-03),
    3: (205.57, 2.72e19, 1024, 23, 16, 64, 1024, 5, 16, 39850, 23.34, 585728, 1, 13, 2.15e-03),
    4: (315.61, 6.83e19, 1152, 29, 9, 128, 1152, 7, 9, 53691, 36.95, 688128, 3, 7, 1.67e-03),
    5: (494.24, 1.70e20, 1408, 31, 11, 128, 1408, 7, 11, 79141, 58.35, 737280, 6, 5, 1.29e-03),
    6: (757.47, 4.07e20, 1664, 34, 13, 128, 1664, 8, 13, 114660, 90.17, 786432, 16, 3, 1.01e-03),
    7: (1176.29, 9.99e20, 1920, 41, 15, 128, 1920, 10, 15, 176106, 141.38, 802816, 56, 1, 9.00e-04),
    8: (5411.7, 5.0e21, 2560, 52, 20, 128, 2560, 13, 20, 304688, 319.49, 1048576, 128, 1, 6.00e-04),
}


def load(name):
    return load_config(APP.args_cls, [f"config={CONFIGS / name}", "dump_dir=unused"])


def meta_model(cfg, vocab):
    with torch.device("meta"):
        return CrossBert(cfg.model, vocab)


def test_single_scale_parameter_counts():
    """Appendix A: encoder 236.8M (768 dim, 28 layers, RoBERTa's 50265 vocab), predictor ~42M, CrossBERT 279M."""
    cfg = load("single_scale.yaml")
    enc, pred = cfg.model.encoder, cfg.model.predictor_transformer()
    assert (enc.dim, enc.n_layers, enc.n_heads, pred.dim, pred.n_layers, pred.n_heads) == (768, 28, 12, 768, 6, 12)
    assert cfg.data.seq_len == 512 and cfg.model.mask_ratio == 0.5 and cfg.model.cms and cfg.optim.lr == 6e-4
    for vocab in (ROBERTA_VOCAB, OUR_VOCAB):
        model = meta_model(cfg, vocab)
        norms_enc, norms_pred = (2 * 28 + 1) * 768, (2 * 6 + 1) * 768
        assert count_params(model.encoder) == non_embedding_params(enc) + vocab * 768 + norms_enc
        assert count_params(model.predictor) == non_embedding_params(pred) + norms_pred + 768  # + mask embedding
    model = meta_model(cfg, ROBERTA_VOCAB)
    assert round(count_params(model.encoder) / 1e6, 1) == 236.8
    assert round(count_params(model.predictor) / 1e6) == 42
    assert round(count_params(model) / 1e6) == 279
    # 384 sequences per step, each giving two 512-token views: 393,216 token-views (the paper's "~393k").
    assert cfg.data.batch_size * cfg.grad_acc_steps * 8 * 512 * 2 == 393216  # on 8 GPUs


def test_debug_config_matches_berts_so_the_apps_compare_directly():
    from apps.bert.train import APP as BERT

    cfg = load("debug.yaml")
    bert = load_config(BERT.args_cls, [f"config={REPO / 'apps/bert/configs/debug.yaml'}", "dump_dir=unused"])
    for section in ("data", "optim", "logging", "validation", "checkpoint", "steps", "seed"):
        assert getattr(cfg, section) == getattr(bert, section), section
    assert cfg.model.encoder == bert.model.encoder


@pytest.mark.parametrize("model_id", sorted(APPENDIX_J))
def test_appendix_j_configs(model_id):
    params, flops, dim, layers, heads, head_dim, pdim, players, pheads, steps, tokens_b, bsz, gpus, grad_acc, lr = (
        APPENDIX_J[model_id]
    )
    cfg = load(f"scaling_{model_id}.yaml")
    enc, pred = cfg.model.encoder, cfg.model.predictor_transformer()
    assert (enc.dim, enc.n_layers, enc.n_heads, enc.dim // enc.n_heads) == (dim, layers, heads, head_dim)
    assert (pred.dim, pred.n_layers, pred.n_heads) == (pdim, players, pheads)
    assert cfg.model.mask_ratio == 0.5 and cfg.model.cms and cfg.data.seq_len == 512
    assert (cfg.steps, cfg.grad_acc_steps, cfg.optim.lr) == (steps, grad_acc, lr)
    assert (cfg.optim.lr_min, cfg.optim.beta1, cfg.optim.beta2) == (1e-6, 0.9, 0.95)
    # BSZ counts token-views: per-GPU sequences x GPUs x grad acc x 512 tokens x 2 views (CMS).
    model = meta_model(cfg, ROBERTA_VOCAB)
    token_views = cfg.data.batch_size * gpus * grad_acc * 512 * model.views_per_sequence
    assert token_views == bsz
    assert steps * bsz / 1e9 == pytest.approx(tokens_b, abs=0.006)  # D = Steps x BSZ = the Tokens column
    assert model.flops_per_token_view(512) * steps * bsz == pytest.approx(flops, rel=0.025)  # C = F_N D, eq. 6-8
    # The Params column is half the total parameter count (eq. 8's weighting at r = 0.5) for IDs 0-7; ID 8 lists
    # the total with an untied output embedding instead.
    total, embedding = count_params(model), ROBERTA_VOCAB * dim
    norms = (2 * layers + 1 + 2 * players + 1) * dim + dim  # not in N, nor in the paper's count
    expected = (total - norms) / 2 if model_id < 8 else total - norms + embedding
    assert expected / 1e6 == pytest.approx(params, abs=0.01 if model_id < 8 else 0.07)  # ID 8 has one decimal


# ---------------------------------------------------------------- end-to-end


def run(argv):
    return train(APP, load_config(APP.args_cls, argv))


def test_debug_run_loss_falls_and_resumes_exactly(corpus, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(tiny_argv(corpus, full, steps=40))
    metrics = read_metrics(full)
    losses = {step: m["loss"] for step, m in metrics.items()}
    assert sum(losses[s] for s in range(36, 41)) / 5 < sum(losses[s] for s in range(1, 6)) / 5 - 1.0
    record = metrics[40]
    assert record["token_views_per_s"] == pytest.approx(2 * record["data_tokens_per_s"])
    assert record["predicted_tokens_per_s"] == pytest.approx(record["data_tokens_per_s"], rel=0.01)  # CMS: all
    model, config, tokenizer = load_model(full)  # the exported model, rebuilt through apps.crossbert.train
    encoded = model.encode(torch.tensor([tokenizer.encode("the cat")]))
    assert isinstance(model, CrossBert) and encoded.shape == (1, 7, 32)
    shutil.copytree(full, resumed)
    for later in ("0000000030", "0000000040"):
        shutil.rmtree(resumed / "checkpoints" / later)
    (resumed / "consolidated.pt").unlink()
    run(tiny_argv(corpus, resumed, steps=40))
    continued = read_metrics(resumed)
    assert sorted(continued) == list(range(1, 41))
    assert all(continued[s]["loss"] == losses[s] for s in range(21, 41))
