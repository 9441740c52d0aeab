"""The hardware FLOPs behind `mfu_hw`, written out by hand for one small shape per app, and their place in the
metrics beside the paper's `mfu`.

The shape: width 8, 2 heads of 4, SwiGLU hidden 24 (ffn_multiple_of 8), vocabulary 100, sequences of 10. One block
holds 4·8·8 + 3·8·24 = 832 matrix weights, so a 2-layer encoder runs 6·2·832 = 9984 FLOPs per token in its
matrices; attention over k keys costs 12·(2·4)·k per layer; the tied head 6·8·100 = 4800 per predicted token.
"""

import pytest
import torch

from apps.bert.model import Bert, BertArgs
from apps.crossbert.model import CrossBert, CrossBertArgs, PredictorArgs
from apps.electra.model import Electra, ElectraArgs, GeneratorArgs
from lingua.metrics import Throughput, format_progress
from lingua.model.transformer import TransformerArgs

ENCODER = TransformerArgs(dim=8, n_layers=2, n_heads=2, ffn_multiple_of=8, max_seqlen=16)
VOCAB, S = 100, 10


def on_meta(build):
    with torch.device("meta"):
        return build()


def test_bert_runs_its_encoder_over_the_row_and_its_head_on_the_masked_tokens():
    bert = on_meta(lambda: Bert(BertArgs(encoder=ENCODER, mask_ratio=0.2), VOCAB, mask_id=VOCAB - 1))
    # 2 of 10 tokens masked: 9984 + 12·8·10·2 (attention over the 10) + 4800·2/10
    assert bert.hardware_flops_per_token_view(S) == 9984 + 1920 + 960


def test_crossbert_views_attend_over_their_own_visible_tokens():
    args = CrossBertArgs(encoder=ENCODER, predictor=PredictorArgs(n_layers=1), mask_ratio=0.5)
    crossbert = on_meta(lambda: CrossBert(args, VOCAB))
    # With CMS each view encodes 5 visible tokens and predicts 5. Encoder per token: 9984 + 12·8·5·2 = 10944.
    # Predictor (1 layer): keys and values of each context token 6·2·8·8 = 768; per query the query and output
    # projections and SwiGLU 6·(832 - 128) = 4224, the head 4800, attention over the view's 5 keys 12·8·5 = 480.
    per_view = 5 * (10944 + 768) + 5 * (4224 + 4800 + 480)
    assert crossbert.hardware_flops_per_token_view(S) == 2 * per_view / (2 * S)  # 10608, 2·S token-views
    # The paper's count puts attention at S = 10 for both networks: the hardware count is smaller.
    assert crossbert.hardware_flops_per_token_view(S) < \
        crossbert.flops_per_token_view(S) + crossbert.head_flops_per_token_view(S)
    # A dense view mask computes attention over the whole row of 10, as its kernel does.
    dense = on_meta(lambda: CrossBert(CrossBertArgs(encoder=ENCODER, predictor=PredictorArgs(n_layers=1),
                                                    cms_attention="mask"), VOCAB))
    per_view = 5 * (9984 + 1920 + 768) + 5 * (4224 + 4800 + 960)
    assert dense.hardware_flops_per_token_view(S) == 2 * per_view / (2 * S)


def test_electra_runs_generator_and_discriminator_and_both_heads():
    electra = on_meta(lambda: Electra(ElectraArgs(encoder=ENCODER, generator=GeneratorArgs(n_layers=1),
                                                  mask_ratio=0.2), VOCAB, mask_id=VOCAB - 1))
    # discriminator 9984 + 1920; generator (1 layer) 6·832 + 12·8·10 = 4992 + 960; the generator's head on 2 of
    # 10 tokens 960; the RTD head 6·8 on every token
    assert electra.hardware_flops_per_token_view(S) == 11904 + 5952 + 960 + 48


def test_mfu_hw_is_logged_beside_mfu():
    bert = on_meta(lambda: Bert(BertArgs(encoder=ENCODER, mask_ratio=0.2), VOCAB, mask_id=VOCAB - 1))
    throughput = Throughput(bert, rows_per_rank=2, row_tokens=S, seq_len=S, world_size=2, peak=1e9)
    throughput.step(predicted_tokens=4, waited_s=0.0)
    record = throughput.report(data_tokens=2 * 2 * S)
    with_head = bert.flops_per_token_view(S) + bert.head_flops_per_token_view(S)
    assert record["mfu_hw"] / record["mfu"] == pytest.approx(bert.hardware_flops_per_token_view(S) / with_head)
    assert "mfu_hw " in format_progress({"step": 1, **record}, 10)
    assert Throughput(bert, 2, S, S, 1, peak=None).report(2 * S)["mfu_hw"] is None  # a CPU: no peak, no MFU
