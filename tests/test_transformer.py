import dataclasses
import math

import pytest
import torch

from lingua.errors import UserError
from lingua.model.flops import count_params, non_embedding_params
from lingua.model.transformer import (
    ATTN_BACKENDS,
    AttnMask,
    CrossAttentionBlock,
    Encoder,
    TransformerArgs,
    apply_rope,
    attention,
    build_attn_bias,
    ffn_hidden_dim,
    init_weights,
)

TINY = TransformerArgs(dim=32, n_layers=2, n_heads=4, max_seqlen=64)


def build_encoder(args=TINY, vocab=50):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Encoder(args, vocab)
    model.to_empty(device="cpu")
    init_weights(model, args.init_std)
    return model


def test_ffn_hidden_dim_rule():
    assert ffn_hidden_dim(768, 256) == 2048
    assert ffn_hidden_dim(1664, 256) == 4608
    assert ffn_hidden_dim(640, 256) == 1792


def test_param_count_matches_formula():
    model = build_encoder()
    norms = (2 * TINY.n_layers + 1) * TINY.dim
    assert count_params(model) == non_embedding_params(TINY) + 50 * TINY.dim + norms


def test_init_is_truncated_normal_with_configured_std():
    args = TransformerArgs(dim=256, n_layers=1, n_heads=4, init_std=0.05)
    w = build_encoder(args).layers[0].feed_forward.w1.weight
    assert abs(w.std().item() - 0.05 * 0.9866) < 0.002  # a normal truncated at 3 sigma has std 0.9866 sigma
    assert w.abs().max().item() <= 3 * 0.05 + 1e-6


def test_output_bias_starts_at_zero_and_enters_the_head():
    model = build_encoder(dataclasses.replace(TINY, output_bias=True))
    assert build_encoder().output_bias is None and torch.equal(model.output_bias, torch.zeros(50))
    hidden, targets = torch.randn(3, 7, TINY.dim), torch.randint(0, 50, (3, 7))
    before = model.lm_loss(hidden, targets)[0]
    with torch.no_grad():
        model.output_bias[targets.flatten()] += 1.0  # the targets' logits go up, so the loss goes down
    assert model.lm_loss(hidden, targets)[0] < before
    torch.testing.assert_close(model.logits(hidden), hidden @ model.tok_embeddings.weight.t() + model.output_bias)


def test_rope_depends_only_on_relative_position():
    model = build_encoder()
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)

    def score(pq, pk):
        rq = apply_rope(q, model.rope(torch.tensor([[pq]])))
        rk = apply_rope(k, model.rope(torch.tensor([[pk]])))
        return (rq * rk).sum(-1)

    assert torch.allclose(score(3, 7), score(10, 14), atol=1e-5)
    assert not torch.allclose(score(3, 7), score(3, 8), atol=1e-3)


def test_positions_travel_with_gathered_tokens():
    """A permuted sequence with permuted positions gives the permuted outputs: order comes only from positions."""
    model = build_encoder()
    tokens = torch.randint(0, 50, (1, 12))
    positions = torch.arange(12)[None]
    perm = torch.randperm(12)[None]
    out = model(tokens, positions)
    out_perm = model(tokens.gather(1, perm), positions.gather(1, perm))
    assert torch.allclose(out[0, perm[0]], out_perm[0], atol=1e-5)


def test_group_ids_isolate_segments():
    model = build_encoder()
    tokens = torch.randint(0, 50, (1, 10))
    ids = torch.tensor([[0] * 6 + [1] * 4])
    positions = torch.arange(10)[None]
    out = model(tokens, positions, AttnMask(ids, ids))
    alone = model(tokens[:, :6], positions[:, :6])
    assert torch.allclose(out[:, :6], alone, atol=1e-5)
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 50
    assert torch.allclose(model(changed, positions, AttnMask(ids, ids))[:, :6], out[:, :6])


def test_cross_attention_queries_are_independent():
    block = CrossAttentionBlock(TINY)
    init_weights(block, 0.02)
    rope = build_encoder().rope
    q, ctx = torch.randn(1, 5, 32), torch.randn(1, 7, 32)
    qpos, kpos = torch.arange(5)[None], torch.arange(5, 12)[None]
    out = block(q, ctx, rope(qpos), rope(kpos), None)
    q2 = q.clone()
    q2[0, 2] += 1.0
    out2 = block(q2, ctx, rope(qpos), rope(kpos), None)
    others = [0, 1, 3, 4]
    assert torch.allclose(out[0, others], out2[0, others])
    assert not torch.allclose(out[0, 2], out2[0, 2])


def _random_qkv_and_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 16, 2, 8), torch.randn(2, 24, 2, 8), torch.randn(2, 24, 2, 8)
    mask = AttnMask(torch.randint(0, 3, (2, 16)), torch.arange(24).remainder(3).expand(2, -1))
    return q, k, v, mask


def test_sdpa_mask_matches_reference():
    q, k, v, mask = _random_qkv_and_mask()
    out = attention(q, k, v, build_attn_bias(mask, "sdpa", 2), "sdpa")
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    allowed = (mask.q_ids[:, :, None] == mask.kv_ids[:, None, :])[:, None]
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_every_registered_backend_is_a_config_choice_and_nothing_else_is():
    for name, backend in ATTN_BACKENDS.items():
        assert backend.name == name and TransformerArgs(attn_backend=name).attn_backend == name
    with pytest.raises(UserError, match="attn_backend.*must be one of sdpa, flex, xformers, got 'flash'"):
        TransformerArgs(attn_backend="flash")


@pytest.mark.parametrize("backend", [name for name in ATTN_BACKENDS if name != "sdpa"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: the values
def test_backends_agree_with_sdpa(backend):
    q, k, v, mask = _random_qkv_and_mask()
    if backend == "xformers":
        pytest.importorskip("xformers")
        if not torch.cuda.is_available():
            pytest.skip("xformers has no CPU kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = q.to(device), k.to(device), v.to(device)
    mask = AttnMask(mask.q_ids.to(device), mask.kv_ids.to(device))
    ref = attention(q, k, v, build_attn_bias(mask, "sdpa", 2), "sdpa")
    out = attention(q, k, v, build_attn_bias(mask, backend, 2), backend)
    assert torch.allclose(out, ref, atol=2e-3)
