"""ELECTRA: replacement labels, sampling without gradient, static shapes, Table 3's size and compute, an end-to-end
run that resumes exactly (sampling included), and the frozen GLUE command on its checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import kill_after_first_checkpoint_then_restart, read_metrics, tiny_argv

from apps.electra.model import Electra, ElectraArgs, GeneratorArgs, corrupt, sample_replacements
from apps.electra.train import APP
from lingua.app import load_model
from lingua.args import load_config
from lingua.model.flops import count_params
from lingua.model.transformer import TransformerArgs
from lingua.train import train
from tools.eval import glue as glue_command

MASK_ID, VOCAB = 99, 100
REPO = Path(__file__).resolve().parents[1]


def tiny(mask_ratio=0.25) -> Electra:
    torch.manual_seed(0)
    args = ElectraArgs(TransformerArgs(dim=16, n_layers=2, n_heads=2, max_seqlen=32), GeneratorArgs(n_layers=1),
                       mask_ratio=mask_ratio)
    model = Electra(args, VOCAB, MASK_ID)
    model.init_weights()
    return model


def test_replacement_labels_count_a_sampled_original_as_original():
    tokens = torch.tensor([[5, 6, 7, 8]])
    corrupted, labels = corrupt(tokens, torch.tensor([[1, 3]]), torch.tensor([[6, 9]]))  # 6 is position 1's own
    assert corrupted.tolist() == [[5, 6, 7, 9]] and labels.tolist() == [[0, 0, 0, 1]]


def test_inverse_cdf_sampling():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [-1e4, 5.0, -1e4, -1e4]]])
    picks = [sample_replacements(logits, torch.tensor([[u, u]])).tolist()[0] for u in (0.0, 0.3, 0.6, 1 - 2**-24)]
    assert [p[0] for p in picks] == [0, 1, 2, 3]  # uniform distribution: the quarter u falls in
    assert all(p[1] == 1 for p in picks)  # a peaked one: always its mode
    uniforms = torch.rand(1, 20000)
    counts = torch.bincount(sample_replacements(torch.tensor([[[0.0, 1.0, 2.0]]]).expand(1, 20000, 3), uniforms)[0])
    assert torch.allclose(counts / 20000, torch.tensor([0.0, 1.0, 2.0]).softmax(0), atol=0.02)


def test_masking_is_static_and_the_batch_carries_the_randomness():
    model, generator = tiny(), torch.Generator().manual_seed(0)
    batch = model.make_batch(torch.randint(0, 90, (3, 32)), generator)
    assert batch["mask_idx"].shape == batch["uniforms"].shape == (3, 8)  # round(0.25 * 32)
    assert ((batch["inputs"] == MASK_ID).sum(1) == 8).all()
    loss_a, stats_a = model(**batch)
    loss_b, stats_b = model(**batch)  # forward draws nothing: the same batch gives the same loss
    assert torch.equal(loss_a, loss_b) and stats_a.keys() == {"accuracy", "mlm_loss", "rtd_loss",
                                                              "generator_accuracy", "replaced"}
    assert torch.allclose(loss_a, stats_a["mlm_loss"] + 50 * stats_a["rtd_loss"])


def test_no_rtd_gradient_reaches_the_generator():
    model = tiny()
    batch = model.make_batch(torch.randint(0, 90, (2, 32)), torch.Generator().manual_seed(0))
    mlm_loss, rtd_loss, _ = model.losses(**batch)
    rtd_loss.backward()
    assert all(p.grad is None for p in model.generator.parameters())  # the sampling is not differentiated
    assert model.discriminator.tok_embeddings.weight.grad is not None  # the shared embeddings learn from both
    mlm_loss.backward()
    assert all(p.grad is not None for p in model.generator.layers.parameters())


def test_single_scale_config_matches_table_3():
    cfg = load_config(APP.args_cls, [f"config={REPO / 'apps/electra/configs/single_scale.yaml'}"])
    with torch.device("meta"):
        model = APP.build_model(cfg.model, type("Tok", (), {"vocab_size": 50265, "mask_id": 50264})())
    assert count_params(model) / 1e6 == pytest.approx(258, rel=0.005)  # Table 3 (RoBERTa's vocabulary)
    tokens = cfg.steps * cfg.data.batch_size * 8 * cfg.data.seq_len  # 8 GPUs
    assert tokens == pytest.approx(50e9, rel=0.001)
    flops = model.flops_per_token_view(cfg.data.seq_len) * tokens  # eq. 7 for both networks, heads left out
    assert flops == pytest.approx(7.31e19, rel=0.001)
    heads = model.head_flops_per_token_view(cfg.data.seq_len) * tokens
    assert flops + heads == pytest.approx(7.5e19, rel=0.01)  # Table 3's, which counts the generator's head


def test_debug_run_loss_falls_and_resumes_exactly_after_a_kill(corpus, tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    options = ["checkpoint.every=5", "model.generator.n_layers=1", "optim.lr=1e-3"]
    kill_after_first_checkpoint_then_restart("apps.electra.train", tiny_argv(corpus, killed, 30) + options, killed)
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, reference, 30) + options))
    expected, got = read_metrics(reference), read_metrics(killed)
    assert sorted(got) == list(range(1, 31))
    assert all(got[s]["loss"] == expected[s]["loss"] and got[s]["replaced"] == expected[s]["replaced"] for s in got)
    assert sum(expected[s]["mlm_loss"] for s in range(26, 31)) < sum(expected[s]["mlm_loss"] for s in range(1, 6))
    # the discriminator beats calling every token original
    assert sum(expected[s]["accuracy"] - (1 - expected[s]["replaced"]) for s in range(26, 31)) / 5 > 0.005
    assert expected[30]["predicted_tokens_per_s"] == pytest.approx(expected[30]["data_tokens_per_s"], rel=0.01)


def test_glue_command_probes_the_discriminator(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    train(APP, load_config(APP.args_cls, tiny_argv(corpus, dump, 2)))
    model, _, _ = load_model(dump)
    assert isinstance(model, Electra)
    glue_command.main([f"ckpt={dump}", f"data={REPO / 'tests' / 'fixtures' / 'glue'}", "tasks=sst2,stsb"])
    results = json.loads((dump / "glue_eval" / "0000000002" / "results.json").read_text())
    assert set(results["tasks"]) == {"sst2", "stsb"} and "linear" in capsys.readouterr().out
    shutil.rmtree(dump)
