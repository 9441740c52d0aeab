"""The BERT configs reproduce the paper's models: Appendix J parameters and FLOPs (eq. 6-7), single-scale shape."""

from pathlib import Path

import pytest
import torch

from apps.bert.model import BertArgs, build_bert
from apps.bert.train import APP
from lingua.args import load_config
from lingua.model.flops import count_params, encoder_flops_per_token, non_embedding_params

CONFIGS = Path(__file__).resolve().parents[1] / "apps" / "bert" / "configs"
PAPER_VOCAB = 50265  # RoBERTa's vocabulary, which the paper's parameter counts use

# Appendix J: id -> (params in millions, FLOPs, tokens in billions, GPUs, heads, head dim, steps, lr)
APPENDIX_J = {
    0: (76.73, 2.17e18, 6.58, 4, 9, 64, 15019, 2.75e-03),
    1: (103.28, 4.64e18, 9.63, 1, 10, 64, 18268, 2.29e-03),
    2: (151.85, 1.14e19, 15.10, 1, 12, 64, 24783, 1.85e-03),
    3: (226.70, 2.83e19, 23.78, 1, 14, 64, 29287, 1.48e-03),
    4: (334.06, 6.73e19, 36.68, 3, 16, 64, 36291, 1.21e-03),
    5: (503.81, 1.65e20, 57.47, 6, 9, 128, 46771, 9.72e-04),
    6: (795.27, 4.24e20, 92.13, 16, 11, 128, 58575, 7.75e-04),
    7: (1208.24, 1.00e21, 141.70, 40, 13, 128, 72072, 6.30e-04),
}


def load(name):
    return load_config(APP.args_cls, [f"config={CONFIGS / name}"])


@pytest.mark.parametrize("model_id", sorted(APPENDIX_J))
def test_scaling_configs_match_appendix_j(model_id):
    params_m, flops, tokens_b, gpus, heads, head_dim, steps, lr = APPENDIX_J[model_id]
    cfg = load(f"scaling_{model_id}.yaml")
    enc = cfg.model.encoder
    assert (enc.n_heads, enc.head_dim, cfg.steps, cfg.optim.lr) == (heads, head_dim, steps, lr)
    assert (cfg.optim.lr_min, cfg.optim.beta1, cfg.optim.beta2, cfg.model.mask_ratio) == (1e-6, 0.9, 0.95, 0.2)
    assert (non_embedding_params(enc) + PAPER_VOCAB * enc.dim) / 1e6 == pytest.approx(params_m, abs=0.01)
    tokens = cfg.steps * cfg.data.batch_size * cfg.grad_acc_steps * gpus * cfg.data.seq_len
    assert tokens / 1e9 == pytest.approx(tokens_b, abs=0.01)
    assert encoder_flops_per_token(enc, cfg.data.seq_len) * tokens == pytest.approx(flops, rel=0.01)  # C = F_N D


def test_single_scale_parameter_count():
    cfg = load("single_scale.yaml")
    with torch.device("meta"):
        model = build_bert(cfg.model, type("Tok", (), {"vocab_size": PAPER_VOCAB, "mask_id": 0})())
    norms = (2 * cfg.model.encoder.n_layers + 1) * cfg.model.encoder.dim
    assert count_params(model) == non_embedding_params(cfg.model.encoder) + PAPER_VOCAB * 768 + norms
    assert count_params(model) / 1e6 == pytest.approx(236.8, abs=0.1)  # the paper's encoder (Appendix A)


def test_debug_config_loads():
    cfg = load("debug.yaml")
    assert isinstance(cfg.model, BertArgs) and cfg.data.seq_len <= cfg.model.encoder.max_seqlen
