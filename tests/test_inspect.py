"""apps.crossbert.inspect: the attention weights it reports are the predictor's own, a branch that adds the same
vector everywhere is reported as such, and the command reports every head and branch of a trained run or refuses a
checkpoint without a predictor in one line."""

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_argv, write_corpus

from apps.bert.train import APP as BERT
from apps.crossbert.inspect import attention_weights, inspect, main
from apps.crossbert.model import CrossBertArgs, PredictorArgs, build_crossbert
from apps.crossbert.train import APP as CROSSBERT
from lingua.app import build_model
from lingua.args import load_config
from lingua.model.transformer import TransformerArgs
from lingua.train import train


def test_attention_weights_are_those_the_predictor_uses():
    args = CrossBertArgs(encoder=TransformerArgs(dim=32, n_layers=2, n_heads=2, max_seqlen=16), cms=False)
    model = build_model(build_crossbert, args, SimpleNamespace(vocab_size=40, mask_id=39), torch.device("cpu"), 0)
    attention, rope = model.predictor.layers[0].attention, model.predictor.rope
    generator = torch.Generator().manual_seed(0)
    x, context = torch.randn(3, 5, 32, generator=generator), torch.randn(3, 7, 32, generator=generator)
    q_pos, kv_pos = torch.randint(0, 16, (3, 5), generator=generator), torch.randint(0, 16, (3, 7), generator=generator)
    with torch.no_grad():
        weights = attention_weights(attention, x, context, rope(q_pos), rope(kv_pos))
        values = attention.wv(context).view(3, 7, 2, 16)
        rebuilt = attention.wo(torch.einsum("bhqk,bkhd->bqhd", weights, values).reshape(3, 5, 32))
        expected = attention(x, context, rope(q_pos), rope(kv_pos), None, "sdpa")
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 2, 5))
    torch.testing.assert_close(rebuilt, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cms", [True, False])
def test_inspects_what_training_predicts_and_leaves_no_hook(cms):
    args = CrossBertArgs(encoder=TransformerArgs(dim=32, n_layers=2, n_heads=2, max_seqlen=16),
                         predictor=PredictorArgs(n_layers=2), cms=cms, mask_ratio=0.3)
    model = build_model(build_crossbert, args, SimpleNamespace(vocab_size=40, mask_id=39), torch.device("cpu"), 0)
    tokens = torch.randint(0, 39, (4, 16), generator=torch.Generator().manual_seed(0))
    found = inspect(model, tokens, seed=1)
    batch = model.make_batch(tokens, torch.Generator().manual_seed(1))
    with torch.no_grad():
        predictions = model.encoder.logits(model.predict(batch["inputs"], batch["positions"],
                                                         batch["query_positions"])).argmax(-1)
    view_a = args.layout(16).views[0].masked  # inspect reads view A, the first queries of each row
    assert found["accuracy"] == (predictions == batch["targets"])[:, :view_a].float().mean().item()
    assert len(found["heads"]) == 2 * 2 and found["uniform"] == 1 / (16 - view_a)
    assert not any(module._forward_hooks for module in model.predictor.modules())


def test_branch_sizes_separate_what_varies_between_positions():
    args = CrossBertArgs(encoder=TransformerArgs(dim=32, n_layers=2, n_heads=2, max_seqlen=16),
                         predictor=PredictorArgs(n_layers=2))
    model = build_model(build_crossbert, args, SimpleNamespace(vocab_size=40, mask_id=39), torch.device("cpu"), 0)
    tokens = torch.randint(0, 39, (4, 16), generator=torch.Generator().manual_seed(0))
    varied = inspect(model, tokens, seed=0)["branches"]
    with torch.no_grad():  # every token the same vector: the encoder's output, hence every branch, is one vector
        model.encoder.tok_embeddings.weight.copy_(model.encoder.tok_embeddings.weight[:1].clone())
    constant = inspect(model, tokens, seed=0)["branches"]
    names = ["0.attention", "0.feed-forward", "1.attention", "1.feed-forward"]
    assert [b["name"] for b in varied] == [b["name"] for b in constant] == names
    assert all(b["varying"] > 0.1 * b["rms"] for b in varied if b["name"] == "0.attention")
    assert all(b["rms"] > 0 and b["varying"] < 1e-5 * b["rms"] for b in constant)


@pytest.mark.parametrize("cms", [True, False])
def test_reports_every_head_of_a_trained_run(tmp_path, capsys, cms):
    dump = tmp_path / "run"
    argv = tiny_argv(write_corpus(tmp_path / "data"), dump, 6) + ["validation.every=0", f"model.cms={cms}",
                                                                  "model.predictor.n_layers=2"]
    train(CROSSBERT, load_config(CROSSBERT.args_cls, argv))
    main([f"ckpt={dump}", "n_sequences=8"])
    out = capsys.readouterr().out
    heads = re.findall(r"^  (\d)\.(\d)  ([0-9.]+)((?:  ?[0-9.]+){7})$", out, re.M)
    assert [(block, head) for block, head, *_ in heads] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], out
    assert all(0 < float(entropy) <= 1 for *_, entropy, _ in heads)
    assert re.search(r"embeddings [0-9.]+, encoder output [0-9.]+, predictor output [0-9.]+", out)
    branches = re.findall(r"^  (\d\.[a-z-]+)  [0-9.]+  [0-9.]+$", out, re.M)
    assert branches == ["0.attention", "0.feed-forward", "1.attention", "1.feed-forward"], out


def test_refuses_a_checkpoint_without_predictor(tmp_path, capsys):
    dump = tmp_path / "bert"
    argv = tiny_argv(write_corpus(tmp_path / "data"), dump, 2) + ["validation.every=0"]
    train(BERT, load_config(BERT.args_cls, argv))
    with pytest.raises(SystemExit) as stop:
        main([f"ckpt={dump}"])
    assert stop.value.code == 2 and "is not a CrossBERT checkpoint" in capsys.readouterr().err
