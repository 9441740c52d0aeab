"""Frozen-feature probes (paper section 4.1): closed-form ridge regression, kNN, and the GLUE metrics.

Pure tensor maths on whatever device the inputs live on; nothing here knows about models or data files.

Ridge conventions (what `ridge_sweep` and `ridge_fit` both do):
- Features are standardised with the mean and standard deviation of the *training subset* (constant features keep
  scale 1); the same statistics are applied to the evaluation features.
- The bias is not regularised: X (standardised, hence centred) and Y are centred, W = (XᵀX + λI)⁻¹XᵀY is solved on
  the centred data, and the intercept is the training mean of Y. Predictions are X_eval W + mean(Y).
- Maths is done in float64, so the λ sweep and a direct solve agree to round-off.
"""

import math

import torch
from torch import Tensor


def lambda_grid(num: int = 9, low: float = 1.0, high: float = 1e4) -> Tensor:
    """Log-spaced ridge strengths from `low` to `high` (the paper sweeps λ in [1, 1e4])."""
    return torch.logspace(math.log10(low), math.log10(high), num, dtype=torch.float64)


def subset_sizes(n_train: int, cap: int = 10_000) -> list[int]:
    """Logarithmic training-set sizes 1, 10, 100, ... below min(n_train, cap), then min(n_train, cap) itself."""
    largest = min(n_train, cap)
    sizes = []
    while (size := 10 ** len(sizes)) < largest:
        sizes.append(size)
    return sizes + [largest]


def _standard_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation per feature; constant features keep scale 1 (they are zero once centred)."""
    std = x.std(0, unbiased=False)
    return x.mean(0), torch.where(std > 0, std, torch.ones_like(std))


def ridge_sweep(x_train: Tensor, y_train: Tensor, x_eval: Tensor, lambdas: Tensor) -> Tensor:
    """Ridge predictions on `x_eval` for every λ, from one eigendecomposition of XᵀX.

    With XᵀX = V diag(e) Vᵀ, W_λ = V diag(1 / (e + λ)) VᵀXᵀY, so each λ costs one [N_eval, D] x [D, T] product.
    x_train [N, D], y_train [N, T] (one-hot classes or a score column), x_eval [M, D] -> [len(lambdas), M, T].
    """
    x_train = x_train.double()
    mean, std = _standard_stats(x_train)
    z_train, z_eval = (x_train - mean) / std, (x_eval.to(x_train) - mean) / std
    y = y_train.to(z_train).reshape(len(z_train), -1)
    y_mean = y.mean(0)
    eigvals, eigvecs = torch.linalg.eigh(z_train.T @ z_train)
    proj_y = eigvecs.T @ (z_train.T @ (y - y_mean))  # [D, T]
    proj_eval = z_eval @ eigvecs  # [M, D]
    lambdas = lambdas.to(z_train)
    return torch.stack([(proj_eval / (eigvals.clamp_min(0) + lam)) @ proj_y + y_mean for lam in lambdas])


def ridge_fit(x_train: Tensor, y_train: Tensor, lam: float) -> "RidgeModel":
    """One ridge fit with a direct `torch.linalg.solve` (the paper's formulation); same conventions as the sweep."""
    x = x_train.double()
    mean, std = _standard_stats(x)
    z = (x - mean) / std
    y = y_train.to(z).reshape(len(z), -1)
    y_mean = y.mean(0)
    gram = z.T @ z + lam * torch.eye(z.shape[1], dtype=z.dtype, device=z.device)
    weight = torch.linalg.solve(gram, z.T @ (y - y_mean))
    return RidgeModel(mean, std, weight, y_mean)


class RidgeModel:
    """A fitted ridge probe: standardisation statistics, weights [D, T] and the (unregularised) intercept [T]."""

    def __init__(self, mean: Tensor, std: Tensor, weight: Tensor, bias: Tensor):
        self.mean, self.std, self.weight, self.bias = mean, std, weight, bias

    def predict(self, x: Tensor) -> Tensor:
        return ((x.to(self.mean).double() - self.mean) / self.std) @ self.weight + self.bias


def ridge_solve_sweep(x_train: Tensor, y_train: Tensor, x_eval: Tensor, lambdas: Tensor) -> Tensor:
    """Same result as `ridge_sweep`, with one direct solve per λ (slower for long sweeps; a cross-check)."""
    return torch.stack([ridge_fit(x_train, y_train, float(lam)).predict(x_eval) for lam in lambdas])


def knn_predict(x_train: Tensor, y_train: Tensor, x_eval: Tensor, ks: list[int], distance: str,
                num_classes: int | None, max_block: int = 2**24) -> dict[int, Tensor]:
    """kNN predictions on `x_eval` for every k in `ks`, with `distance` "l2" or "cosine".

    Classification (`num_classes` given): majority vote; a tie goes to the tied class whose nearest member is
    closest to the query, so results are deterministic. Regression (`num_classes` None): mean of the neighbours'
    targets. Queries are processed in blocks of at most `max_block` query-train similarities, keeping only each
    block's top-k, so memory stays bounded whatever the split sizes.
    """
    if distance not in ("l2", "cosine"):
        raise ValueError(f"unknown kNN distance '{distance}' (expected l2 or cosine)")
    train = x_train.float()
    if distance == "cosine":
        train = torch.nn.functional.normalize(train, dim=1)
    sq_norms = (train * train).sum(1)
    targets = y_train.to(train.device)
    k_max = min(max(ks), len(train))
    block = max(1, max_block // len(train))
    outputs: dict[int, list[Tensor]] = {k: [] for k in ks}
    for start in range(0, len(x_eval), block):
        query = x_eval[start:start + block].to(train)
        if distance == "cosine":
            sim = torch.nn.functional.normalize(query, dim=1) @ train.T
        else:  # -||q - t||² up to the per-query constant ||q||², which does not change the ranking
            sim = 2 * query @ train.T - sq_norms
        neighbours = sim.topk(k_max, dim=1).indices  # sorted, nearest first
        for k in ks:
            labels = targets[neighbours[:, :k]]
            outputs[k].append(_vote(labels, num_classes) if num_classes else labels.float().mean(1))
    return {k: torch.cat(parts) for k, parts in outputs.items()}


def _vote(labels: Tensor, num_classes: int) -> Tensor:
    """Majority class per row of `labels` [B, k] (nearest first); ties go to the class seen first."""
    batch, k = labels.shape
    labels = labels.long()
    votes = torch.zeros(batch, num_classes, dtype=torch.long, device=labels.device)
    votes.scatter_add_(1, labels, torch.ones_like(labels))
    ranks = torch.arange(k, device=labels.device).expand(batch, k)
    first = torch.full((batch, num_classes), k, dtype=torch.long, device=labels.device)
    first.scatter_reduce_(1, labels, ranks, reduce="amin")
    # one more vote always outweighs any difference in first rank (at most k)
    return (votes * (k + 1) - first).argmax(1)


# Metrics: predictions and gold labels are 1-D tensors; results are plain floats in [0, 1] (or [-1, 1]).

def accuracy(pred: Tensor, gold: Tensor) -> float:
    return (pred.long() == gold.long()).double().mean().item()


def f1_score(pred: Tensor, gold: Tensor, positive: int = 1) -> float:
    """F1 of the positive class (QQP: duplicate, MRPC: equivalent); 0 when there is no positive at all."""
    pred_pos, gold_pos = pred.long() == positive, gold.long() == positive
    true_pos = (pred_pos & gold_pos).sum().item()
    denom = pred_pos.sum().item() + gold_pos.sum().item()
    return 2 * true_pos / denom if denom else 0.0


def matthews_corrcoef(pred: Tensor, gold: Tensor) -> float:
    """Matthews correlation (multi-class form, equal to the binary one for two classes); 0 when undefined."""
    pred, gold = pred.long().cpu(), gold.long().cpu()
    num_classes = int(max(pred.max(), gold.max())) + 1
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64)
    confusion.index_put_((gold, pred), torch.ones(len(gold), dtype=torch.float64), accumulate=True)
    n, correct = confusion.sum(), confusion.trace()
    true_counts, pred_counts = confusion.sum(1), confusion.sum(0)
    cov = correct * n - true_counts @ pred_counts
    denom = torch.sqrt((n * n - pred_counts @ pred_counts) * (n * n - true_counts @ true_counts))
    return (cov / denom).item() if denom > 0 else 0.0


def pearson(pred: Tensor, gold: Tensor) -> float:
    """Pearson correlation; 0 when either side is constant (e.g. a ridge fit on one example)."""
    x, y = pred.double().cpu(), gold.double().cpu()
    x, y = x - x.mean(), y - y.mean()
    denom = torch.sqrt((x * x).sum() * (y * y).sum())
    return ((x * y).sum() / denom).item() if denom > 0 else 0.0


def spearman(pred: Tensor, gold: Tensor) -> float:
    """Spearman correlation: Pearson on ranks, tied values sharing their average rank."""
    return pearson(_average_ranks(pred.double().cpu()), _average_ranks(gold.double().cpu()))


def _average_ranks(x: Tensor) -> Tensor:
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts
    return (first + (counts - 1) / 2).double()[inverse]


METRICS = {"acc": accuracy, "f1": f1_score, "mcc": matthews_corrcoef, "pearson": pearson, "spearman": spearman}
