"""Table 9 (Appendix I): its pipeline file's stages, the init std one setting away (shared by the three variants)
and changing the init of every network of each app, and ELECTRA's 1B config (BERT's model 7 with a generator)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lingua.app import load_app
from lingua.args import load_config
from lingua.jobs.pipeline_plan import load_pipeline
from lingua.model.flops import count_params

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "docs" / "pipelines" / "table9.yaml"
APPS = ("bert", "electra", "crossbert")


def test_the_pipeline_pretrains_the_1b_models_probes_them_and_prints_table_9():
    pipeline = load_pipeline(str(PIPELINE))
    stages = {stage.name: stage for stage in pipeline.stages}
    assert list(stages) == [*(f"{stage}.{app}" for stage in ("pretrain", "probes") for app in APPS), "table",
                            "spikes"]
    for app, nodes in (("bert", 5), ("electra", 5), ("crossbert", 7)):  # Appendix J: 40 and 56 GPUs
        pretrain = stages[f"pretrain.{app}"]
        assert pretrain.module == f"apps.{app}.train" and (pretrain.launcher["nodes"], pretrain.launcher[
            "gpus_per_node"]) == (str(nodes), 8)
        assert f"config=apps/{app}/configs/scaling_7.yaml" in pretrain.args
        assert "model.encoder.init_std=0.02" in pretrain.args
        assert stages[f"probes.{app}"].after == [f"pretrain.{app}"] and "probes=linear" in stages[f"probes.{app}"].args
    assert stages["table"].module == "tools.tables" and "table=9" in stages["table"].args
    assert stages["table"].after == [f"probes.{app}" for app in APPS]
    assert stages["spikes"].after == [f"pretrain.{app}" for app in APPS] and "kind=spikes" in stages["spikes"].args


def test_appendix_is_init_std_is_one_setting_for_the_three_models(tmp_path):
    text = PIPELINE.read_text()
    assert text.count('"0.02"') == 1
    (tmp_path / "table9.yaml").write_text(text.replace('"0.02"', '"0.015"'))
    pipeline = load_pipeline(str(tmp_path / "table9.yaml"))
    pretrains = [stage for stage in pipeline.stages if stage.name.startswith("pretrain.")]
    assert len(pretrains) == 3 and all("model.encoder.init_std=0.015" in stage.args for stage in pretrains)


@pytest.mark.parametrize("app_name, networks", [("electra", {"discriminator", "generator"}),
                                                ("crossbert", {"encoder", "predictor"})])
def test_the_init_std_key_sets_the_init_of_every_network(app_name, networks):
    """model.encoder.init_std reaches the encoder and CrossBERT's predictor or ELECTRA's generator alike: each
    matrix is a normal truncated at 3 std (whose std is 0.9866 x the std asked)."""
    app = load_app(app_name)
    args = load_config(app.args_cls, [f"config={REPO}/apps/{app_name}/configs/debug.yaml", "dump_dir=unused",
                                      "model.encoder.init_std=0.05"])
    torch.manual_seed(0)
    model = app.build_model(args.model, SimpleNamespace(vocab_size=1000, mask_id=999, pad_id=998))
    model.init_weights()
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2 and "layers" in name}
    assert {name.split(".")[0] for name in matrices} == networks
    for name, weight in matrices.items():
        assert weight.std().item() == pytest.approx(0.05 * 0.9866, rel=0.1), name
        assert weight.abs().max().item() <= 3 * 0.05 + 1e-6, name


def test_electras_1b_config_is_berts_model_7_with_a_4_block_generator():
    electra, bert = (load_config(load_app(name).args_cls, [f"config={REPO}/apps/{name}/configs/scaling_7.yaml"])
                     for name in ("electra", "bert"))
    assert electra.model.encoder == bert.model.encoder and electra.model.generator.n_layers == 4  # 3 of 28 at 239M
    assert (electra.steps, electra.grad_acc_steps, electra.data.batch_size, electra.optim) == (
        bert.steps, bert.grad_acc_steps, bert.data.batch_size, bert.optim)
    with torch.device("meta"):
        model = load_app("electra").build_model(electra.model, SimpleNamespace(vocab_size=50265, mask_id=50264))
    tokens = electra.steps * electra.data.batch_size * electra.grad_acc_steps * 40 * electra.data.seq_len
    assert tokens == pytest.approx(141.70e9, rel=0.001)  # BERT's Appendix J model 7, on 40 GPUs
    assert count_params(model) / 1e6 == pytest.approx(1344.7, abs=0.1)
    flops, heads = (count(electra.data.seq_len) * tokens for count in (model.flops_per_token_view,
                                                                       model.head_flops_per_token_view))
    assert flops == pytest.approx(1.126e21, rel=0.001) and flops + heads == pytest.approx(1.136e21, rel=0.001)
