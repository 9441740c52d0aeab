"""Scaling laws: compute-optimal plans and power-law fits (paper sections 4.3 and 5.1, Appendices H and J).

Compute C = F_N x D (eq. 6): F_N the training FLOPs per token-view of the model (eq. 7-8, `flops_per_token_view`),
D the token-views trained on. Appendix J holds D / F_N at 20 for every model (D = 20 F_N, so F_N = sqrt(C / 20)),
and sets the batch size BSZ (token-views per step) and the learning rate from power laws of C fitted on sweeps of
small models (Appendix H), keeping the best 3 runs per size.
"""

import math
from dataclasses import dataclass

import numpy as np

TOKENS_PER_FLOP_PER_TOKEN = 20.0  # Appendix J: D / F_N


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * x ** exponent."""

    coefficient: float
    exponent: float

    def __call__(self, x: float) -> float:
        return self.coefficient * x ** self.exponent


@dataclass(frozen=True)
class ScalingLaws:
    """An app's laws (section 5.1): the batch size BSZ (token-views per step) and the learning rate as power laws of
    the compute C, and the family of shapes a plan chooses from."""

    bsz: PowerLaw
    lr: PowerLaw
    shapes_of: str = ""  # the app whose configs/scaling_*.yaml give the shapes (default: the app's own)


# The paper's fits (section 5.1; BSZ in token-views), read at the compute C: against Appendix J's own columns (all 17
# rows) the BSZ laws are within 6.9% (mean 2.6%; CrossBERT's read at C / 2 would be within 11.3%), the LR laws within
# 1.5% but for CrossBERT's models 7 (-13%) and 8 (-17%).
BERT_LAWS = ScalingLaws(bsz=PowerLaw(17.38, 0.24), lr=PowerLaw(69.18, -0.24))
CROSSBERT_LAWS = ScalingLaws(bsz=PowerLaw(1e4, 0.092), lr=PowerLaw(564.6, -0.279))


@dataclass(frozen=True)
class Fit:
    law: PowerLaw
    coefficient_log10_stderr: float  # standard error of log10(coefficient)
    exponent_stderr: float
    points: int


def fit_power_law(x, y) -> Fit:
    """Least squares of log10 y = log10 a + b log10 x, with the standard errors of both parameters."""
    lx, ly = np.log10(np.asarray(x, dtype=float)), np.log10(np.asarray(y, dtype=float))
    if len(lx) < 2 or np.ptp(lx) == 0:
        raise ValueError("a power law needs points at two or more distinct x")
    design = np.stack([np.ones_like(lx), lx], 1)
    (log_a, b), *_ = np.linalg.lstsq(design, ly, rcond=None)
    dof = len(lx) - 2
    if dof > 0:
        residual = ly - design @ np.array([log_a, b])
        covariance = residual @ residual / dof * np.linalg.inv(design.T @ design)
        stderr = np.sqrt(np.diag(covariance))
    else:
        stderr = np.array([math.nan, math.nan])
    return Fit(PowerLaw(10 ** log_a, b), float(stderr[0]), float(stderr[1]), len(lx))


def best_per_group(runs: list[dict], group: str, score: str, keep: int = 3) -> list[dict]:
    """The `keep` runs of lowest `score` in each value of `group` (the paper keeps the best 3 per model size)."""
    chosen = []
    for value in sorted({run[group] for run in runs}):
        members = sorted((run for run in runs if run[group] == value), key=lambda run: run[score])
        chosen += members[:keep]
    return chosen


@dataclass(frozen=True)
class Plan:
    compute: float  # C, FLOPs as the paper counts them
    flops_per_token_view: float  # F_N of the chosen shape
    token_views: float  # D = C / F_N
    batch_token_views: int  # BSZ after rounding to whole sequences per GPU and accumulation step
    sequences_per_step: int
    batch_size: int  # sequences per GPU per micro-step (the config's data.batch_size)
    grad_acc_steps: int
    gpus: int
    steps: int
    lr: float


def plan_batch(
    compute: float,
    flops_per_token_view: float,
    bsz: float,
    lr: float,
    token_views_per_sequence: int,
    gpus: int,
    micro_batch: int,
    grad_acc: int | None = None,
) -> Plan:
    """Rounds the law's BSZ (token-views) to whole sequences, a multiple of gpus x grad_acc; grad_acc (unless given)
    is the fewest accumulation steps that keep each GPU's micro-batch within `micro_batch` sequences."""
    sequences = bsz / token_views_per_sequence
    if grad_acc is None:
        grad_acc = max(1, math.ceil(sequences / (gpus * micro_batch)))
    unit = gpus * grad_acc
    sequences_per_step = max(1, round(sequences / unit)) * unit
    batch = sequences_per_step * token_views_per_sequence
    token_views = compute / flops_per_token_view
    return Plan(compute, flops_per_token_view, token_views, batch, sequences_per_step, sequences_per_step // unit,
                grad_acc, gpus, max(1, round(token_views / batch)), lr)


def nearest_shape(target_flops_per_token: float, shapes: dict[str, float]) -> str:
    """The shape (name -> F_N) nearest to the target on a log scale."""
    return min(shapes, key=lambda name: abs(math.log(shapes[name] / target_flops_per_token)))


def optimal_flops_per_token(compute: float, ratio: float = TOKENS_PER_FLOP_PER_TOKEN) -> float:
    """F_N such that D = ratio F_N spends C = F_N D."""
    return math.sqrt(compute / ratio)
