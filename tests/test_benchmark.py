"""The throughput benchmark (tools/benchmark.py) with preset debug: every figure is produced and consistent with the
models' own accounting (how fast the steps are is not tested)."""

import json

import pytest

from apps.crossbert.model import CrossBertArgs, crossbert_flops_per_token_view
from lingua.model.flops import encoder_flops_per_token
from lingua.model.transformer import TransformerArgs
from tools import benchmark

DEBUG = benchmark.PRESETS["debug"]
S, B, V = DEBUG["seq_len"], DEBUG["batch_size"], DEBUG["vocab_size"]
ENCODER = TransformerArgs(**DEBUG["encoder"])


def run(tmp_path, *argv):
    out = tmp_path / "results.json"
    benchmark.main(["preset=debug", f"out={out}", *argv])
    return json.loads(out.read_text())


def test_debug_preset_figures_are_consistent(tmp_path, capsys):
    report = run(tmp_path, "apps=bert,crossbert,electra,crossbert+cms_attention=mask", "peak_tflops=0.001")
    results = report["results"]
    assert list(results) == ["bert", "crossbert", "electra", "crossbert+cms_attention=mask"]
    assert report["reference"] == "bert"
    for label, r in results.items():
        assert r["steps_timed"] == DEBUG["steps"] * DEBUG["rounds"]
        assert r["step_ms_iqr"][0] <= r["step_ms"] <= r["step_ms_iqr"][1]
        assert r["data_tokens_per_s"] == pytest.approx(B * S / (r["step_ms"] / 1e3))
        assert 0 < r["flops_per_step_paper"] < r["flops_per_step_with_head"]
        assert r["achieved_tflops"] == pytest.approx(r["flops_per_step_with_head"] / (r["step_ms"] / 1e3) / 1e12)
        assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 0.001)
        assert r["mfu_hw"] == pytest.approx(r["flops_per_step_hw"] / (r["step_ms"] / 1e3) / 1e9)
        assert r["peak_memory_gib"] is None  # measured on GPUs only
    bert, crossbert = results["bert"], results["crossbert"]
    # Token-views: CrossBERT's CMS sees each sequence twice and predicts each token once; BERT predicts 20%.
    assert crossbert["token_views_per_s"] == pytest.approx(2 * crossbert["data_tokens_per_s"])
    assert crossbert["predicted_tokens_per_s"] == pytest.approx(crossbert["data_tokens_per_s"])
    assert bert["predicted_tokens_per_s"] == pytest.approx(bert["data_tokens_per_s"] * round(0.2 * S) / S)
    # FLOPs: eq. 7 for BERT, eq. 8 for CrossBERT, plus the tied head 6 d V per predicted token.
    f_bert = encoder_flops_per_token(ENCODER, S)
    cb = CrossBertArgs(encoder=ENCODER)
    f_crossbert = crossbert_flops_per_token_view(ENCODER, cb.predictor_transformer(), cb.layout(S))
    assert bert["flops_per_step_paper"] == pytest.approx(f_bert * B * S)
    assert crossbert["flops_per_step_paper"] == pytest.approx(f_crossbert * 2 * B * S)
    head = 6 * ENCODER.dim * V
    assert bert["flops_per_step_with_head"] == pytest.approx((f_bert + head * 0.2) * B * S)
    assert crossbert["flops_per_step_with_head"] == pytest.approx((f_crossbert + head * 0.5) * 2 * B * S)
    assert results["crossbert+cms_attention=mask"]["flops_per_step_paper"] == crossbert["flops_per_step_paper"]
    # As run, CMS's views attend over their own tokens; a dense view mask runs attention over the whole row, as the
    # paper's count has it (and with r = 0.5 the predictor's keys and values cost what eq. 8 puts on its queries).
    assert crossbert["flops_per_step_hw"] < crossbert["flops_per_step_with_head"]
    assert results["crossbert+cms_attention=mask"]["flops_per_step_hw"] == \
        pytest.approx(crossbert["flops_per_step_with_head"])
    # Speed-ups against BERT: measured in token-views/s, predicted by each FLOPs count.
    assert bert["vs_reference"]["measured"] == 1
    vs = crossbert["vs_reference"]
    assert vs["measured"] == pytest.approx(crossbert["token_views_per_s"] / bert["token_views_per_s"])
    assert vs["predicted_paper"] == pytest.approx(f_bert / f_crossbert)
    assert vs["predicted_with_head"] == pytest.approx((f_bert + head * 0.2) / (f_crossbert + head * 0.5))
    assert vs["of_predicted_with_head"] == pytest.approx(vs["measured"] / vs["predicted_with_head"])
    table = capsys.readouterr().out
    assert all(label in table for label in results) and "speed-up" in table
    assert "the paper (section 5.2): CrossBERT 1.68x BERT (207k vs 123k tokens/s on H100s" in table


def test_huggingface_modernbert_is_measured_beside_bert(tmp_path):
    """The stand-in from transformers reports every figure the apps do; its tokens attend over the whole row, so
    what its kernels run is the paper's count with its head."""
    pytest.importorskip("transformers")
    results = run(tmp_path, "apps=bert,hf-modernbert", "peak_tflops=0.001")["results"]
    modernbert = results["hf-modernbert"]
    assert modernbert["flops_per_step_hw"] == pytest.approx(modernbert["flops_per_step_with_head"])
    assert modernbert["mfu_hw"] == pytest.approx(modernbert["mfu"])


def test_mfu_is_unknown_on_a_cpu_without_a_given_peak(tmp_path, capsys):
    report = run(tmp_path, "apps=crossbert", "warmup=0", "steps=1", "rounds=1")
    assert report["peak_tflops"] is None and report["results"]["crossbert"]["mfu"] is None
    assert report["reference"] == "crossbert"
    assert "unknown" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["apps=bert,gpt"], "unknown app 'gpt'"),
    (["preset=huge"], "config key 'preset' must be one of debug, cpu, paper"),
    (["apps=crossbert+mask_ratio=2"], "config key 'mask_ratio' must be strictly between 0 and 1"),
    (["seq_len=65"], "config key 'seq_len' 65 exceeds encoder.max_seqlen 64"),
])
def test_mistakes_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["preset=debug", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
