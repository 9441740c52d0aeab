"""The paper's pipelines planned, not run (each pre-training is hundreds of H100-hours): every one in stool's dry run,
and in detail Figures 1 and 3's unfrozen stages, Figure 6, Appendix B's data efficiency, Appendix I's variations and
Table 4's aspect ratios. Every pre-training stage's config resolves as its app reads it, every tool stage's arguments
as its command reads them."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lingua import stool
from lingua.app import load_app, short_name
from lingua.args import load_config
from lingua.jobs.pipeline_plan import load_pipeline
from tools import sample_efficiency, scaling_plots

PIPELINES = Path(__file__).resolve().parents[1] / "docs" / "pipelines"


def stages_of(name: str) -> dict:
    return {stage.name: stage for stage in load_pipeline(str(PIPELINES / name)).stages}


def pretraining_config(stage):
    """The config a pre-training stage trains with, as its app resolves it."""
    app = load_app(short_name(stage.module))
    return app, load_config(app.args_cls, [arg for arg in stage.args if not arg.startswith("dump_dir=")])


@pytest.mark.parametrize("path", sorted(PIPELINES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_pipeline_plans_its_stages_in_a_dry_run_and_writes_nothing(path, tmp_path, monkeypatch, capsys):
    """What `python -m lingua.stool pipeline pipeline=FILE --dry-run` prints for each table's and figure's pipeline:
    every stage, its launcher and what it waits for; nothing is submitted or written (its dump_dir is relative)."""
    monkeypatch.chdir(tmp_path)
    stool.main(["pipeline", f"pipeline={path}", "cluster=slurm", "--dry-run"])
    planned = re.search(r"dry run: (\d+) stage\(s\), nothing started", capsys.readouterr().out)
    assert planned and int(planned.group(1)) == len(stages_of(path.name)) and list(tmp_path.iterdir()) == []


def test_figure1_scores_every_model_unfrozen_too_and_plots_both():
    """Section 5.3 reads Figure 1 through the gap between frozen and fine-tuned: Table 3's GLUE fine-tuning recipe
    (MNLI first, then RTE, MRPC, STS-B from it) and contrastive training of the whole model, for each of the 17 runs,
    filed where tools.scaling reads them; the plot, Figures 3 and 4 and the table wait for them."""
    stages = stages_of("figure1.yaml")
    for variant in ("bert_0", "crossbert_8"):
        full = stages[f"contrastive_full.{variant}"]
        assert "model.frozen=false" in full.args and full.after == [f"pretrain.{variant}", "triplets"]
        mteb = stages[f"mteb_v2_full.{variant}"]
        assert mteb.args[-1].endswith(f"{variant}/pretrain/mteb_eval/contrastive_full")  # *_full: the unfrozen series
        first, from_mnli = stages[f"finetune_first.{variant}"], stages[f"finetune_from_mnli.{variant}"]
        assert first.module == from_mnli.module == "tools.finetune.sweep"
        assert "tasks=mnli,qnli,qqp,sst2,cola" in first.args and "tasks=rte,mrpc,stsb" in from_mnli.args
        assert any(arg.endswith(f"{variant}/finetune_first") for arg in from_mnli.args if arg.startswith("mnli_from="))
        assert Path(first.args[1].removeprefix("dump_dir=")).parent.name == variant  # beside VARIANT/pretrain
    for name in ("plot", "figure3", "figure4", "table"):
        assert any(need.startswith(("mteb_v2_full.", "finetune_from_mnli.")) for need in stages[name].after), name
    assert load_config(scaling_plots.PlotArgs, stages["plot"].args[1:]).kind == "probes"


def test_figure6_pretrains_the_single_scale_runs_logging_their_probes_then_plots_them():
    stages = stages_of("figure6.yaml")
    assert list(stages) == ["pretrain.bert", "pretrain.crossbert", "pretrain.electra", "figure6"]
    for app in ("bert", "crossbert", "electra"):
        _, config = pretraining_config(stages[f"pretrain.{app}"])
        assert config.steps == 127157 and config.eval.every == 12716 and config.eval.data == "hf"  # 10 probes
        assert stages[f"pretrain.{app}"].launcher["gpus_per_node"] == 8
    assert load_config(scaling_plots.PlotArgs, stages["figure6"].args[1:]).kind == "training"


def test_appendix_b_runs_table_5s_pair_logging_probes_then_measures_the_data_each_needs():
    """Without CMS a step reads twice the sequences, so both runs process the same token-views per step."""
    stages = stages_of("appendix_b.yaml")
    configs = {variant: pretraining_config(stages[f"pretrain.{variant}"])[1] for variant in ("cms_off", "cms_on")}
    assert [configs[v].model.cms for v in ("cms_off", "cms_on")] == [False, True]
    assert configs["cms_off"].data.batch_size == 2 * configs["cms_on"].data.batch_size
    assert all(config.eval.every == 12716 and config.eval.probes == ["linear"] for config in configs.values())
    efficiency = stages["efficiency"]
    assert efficiency.module == "tools.sample_efficiency" and efficiency.after == ["pretrain.cms_off",
                                                                                   "pretrain.cms_on"]
    assert load_config(sample_efficiency.EfficiencyArgs, efficiency.args).probe == "linear"


def test_appendix_i_varies_berts_seeds_learning_rate_and_batch_at_the_same_tokens_and_tunes_electra():
    stages = stages_of("appendix_i.yaml")
    base = {app: load_config(load_app(app).args_cls, [f"config=apps/{app}/configs/scaling_7.yaml"])
            for app in ("bert", "electra")}
    changed = {}
    for name, stage in stages.items():
        if not name.startswith("pretrain."):
            continue
        app, config = pretraining_config(stage)
        reference = base[short_name(app.name)]
        tokens = config.steps * config.data.batch_size * config.grad_acc_steps * config.data.seq_len
        assert tokens == reference.steps * reference.data.batch_size * reference.grad_acc_steps * 512  # 1e21 FLOPs
        assert config.model.encoder.init_std == 0.02
        changed[name.removeprefix("pretrain.")] = (config.seed, config.data.seed, config.optim.lr,
                                                   config.data.batch_size * config.grad_acc_steps)
    assert changed == {"bert_seeds_1": (1, 1, 6.3e-4, 96), "bert_seeds_2": (2, 2, 6.3e-4, 96),
                       "bert_lr_half": (42, 42, 3.15e-4, 96), "bert_lr_twice": (42, 42, 1.26e-3, 96),
                       "bert_batch_half": (42, 42, 6.3e-4, 48), "bert_batch_twice": (42, 42, 6.3e-4, 192),
                       "electra_lr_half": (42, 42, 3.15e-4, 96), "electra_lr_quarter": (42, 42, 1.575e-4, 96)}
    assert "table=9" in stages["table"].args
    assert load_config(scaling_plots.PlotArgs, stages["spikes"].args[1:]).kind == "spikes"


def test_table4_has_deeper_and_wider_predictors_of_the_same_size_each_labelled_with_its_size():
    """Appendix A's aspect-ratio claim needs shapes of one size: 25M and 42M have three each, within 10 %."""
    pipeline = load_pipeline(str(PIPELINES / "table4.yaml"))
    sizes = {}
    for stage in (s for s in pipeline.stages if s.name.startswith("pretrain.")):
        app, config = pretraining_config(stage)
        with torch.device("meta"):
            model = app.build_model(config.model, SimpleNamespace(vocab_size=50261, mask_id=50260, pad_id=50259))
        params = sum(p.numel() for p in model.predictor.parameters()) / 1e6
        variant = stage.name.removeprefix("pretrain.")
        label = pipeline.variants[variant]["row"]
        assert params == pytest.approx(float(label.split("M")[0]), rel=0.02), variant
        predictor = config.model.predictor
        assert label.endswith(f"({predictor.n_layers} x {predictor.dim})") and predictor.dim // predictor.n_heads == 64
        sizes[variant] = params
    for group in (("pred_14x384", "pred_7x512", "pred_2x960"), ("pred_24x384", "pred_10x576", "pred_6x768",
                                                                 "pred_3x1024")):
        values = [sizes[variant] for variant in group]
        assert max(values) / min(values) < 1.1, group
