from collections import Counter

import pytest
import scipy.stats
import torch

from lingua.eval import probes


def _data(n=60, d=8, t=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 3, d, dtype=torch.float64) + 2
    y = x @ torch.randn(d, t, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(n, t, generator=gen)
    x_eval = torch.randn(20, d, generator=gen, dtype=torch.float64)
    return x, y, x_eval


@pytest.mark.parametrize("lam", [1.0, 10.0, 1e3, 1e4])
def test_ridge_fit_matches_direct_solve_of_the_standardised_centred_problem(lam):
    x, y, x_eval = _data()
    z = (x - x.mean(0)) / x.std(0, unbiased=False)
    yc = y - y.mean(0)
    weight = torch.linalg.solve(z.T @ z + lam * torch.eye(z.shape[1], dtype=z.dtype), z.T @ yc)
    model = probes.ridge_fit(x, y, lam)
    torch.testing.assert_close(model.weight, weight)
    torch.testing.assert_close(model.bias, y.mean(0))
    expected = (x_eval - x.mean(0)) / x.std(0, unbiased=False) @ weight + y.mean(0)
    torch.testing.assert_close(model.predict(x_eval), expected)


@pytest.mark.parametrize("lam", [1.0, 100.0, 1e4])
def test_ridge_fit_matches_scikit_learn(lam):
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y, x_eval = _data()
    mean, std = x.mean(0), x.std(0, unbiased=False)
    reference = linear_model.Ridge(alpha=lam, fit_intercept=True).fit(((x - mean) / std).numpy(), y.numpy())
    expected = torch.from_numpy(reference.predict(((x_eval - mean) / std).numpy()))
    torch.testing.assert_close(probes.ridge_fit(x, y, lam).predict(x_eval), expected)


@pytest.mark.parametrize("n", [1, 5, 60])  # fewer examples than features, too
def test_lambda_sweep_equals_separate_solves(n):
    x, y, x_eval = _data(n=n)
    lambdas = probes.lambda_grid()
    sweep = probes.ridge_sweep(x, y, x_eval, lambdas)
    assert sweep.shape == (len(lambdas), len(x_eval), y.shape[1])
    torch.testing.assert_close(sweep, probes.ridge_solve_sweep(x, y, x_eval, lambdas))


def test_ridge_on_one_example_predicts_its_target():
    x, y, x_eval = _data(n=1)
    sweep = probes.ridge_sweep(x, y, x_eval, probes.lambda_grid(3))
    torch.testing.assert_close(sweep, y.expand(3, len(x_eval), -1))


def test_subset_sizes_are_logarithmic_and_capped():
    assert probes.subset_sizes(1) == [1]
    assert probes.subset_sizes(2490) == [1, 10, 100, 1000, 2490]
    assert probes.subset_sizes(67_349) == [1, 10, 100, 1000, 10_000]
    assert probes.subset_sizes(67_349, cap=500) == [1, 10, 100, 500]
    assert probes.lambda_grid()[[0, -1]].tolist() == pytest.approx([1.0, 1e4])


def _brute_force_knn(x_train, y_train, x_eval, k, distance, num_classes):
    if distance == "cosine":
        x_train = torch.nn.functional.normalize(x_train, dim=1)
        x_eval = torch.nn.functional.normalize(x_eval, dim=1)
        dist = -(x_eval @ x_train.T)
    else:
        dist = torch.cdist(x_eval, x_train)
    preds = []
    for row in dist:
        nearest = [y_train[j].item() for j in row.argsort()[:k].tolist()]
        if num_classes is None:
            preds.append(sum(nearest) / len(nearest))
            continue
        counts = Counter(nearest)
        best = max(counts.values())
        preds.append(next(label for label in nearest if counts[label] == best))  # tie: nearest member wins
    return torch.tensor(preds)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("regression", [False, True])
def test_knn_matches_brute_force(distance, regression):
    gen = torch.Generator().manual_seed(1)
    x_train, x_eval = torch.randn(200, 6, generator=gen), torch.randn(57, 6, generator=gen)
    y_train = torch.rand(200, generator=gen) * 5 if regression else torch.randint(0, 3, (200,), generator=gen)
    num_classes = None if regression else 3
    ks = [1, 2, 3, 10, 30]
    # a tiny block forces many query batches
    got = probes.knn_predict(x_train, y_train, x_eval, ks, distance, num_classes, max_block=200 * 7)
    for k in ks:
        expected = _brute_force_knn(x_train, y_train, x_eval, k, distance, num_classes)
        torch.testing.assert_close(got[k].to(expected.dtype), expected, check_dtype=False)


def test_knn_k_larger_than_train_set_uses_every_example():
    x_train, y_train = torch.tensor([[0.0], [1.0], [5.0]]), torch.tensor([1, 1, 0])
    got = probes.knn_predict(x_train, y_train, torch.tensor([[4.9]]), [1, 30], "l2", 2)
    assert got[1].tolist() == [0] and got[30].tolist() == [1]


def test_knn_vote_tie_goes_to_nearest_class():
    x_train, y_train = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([2, 0, 0, 2])
    # query at 0.9: neighbours by distance are 1 (class 0), 0 (class 2), 2 (class 0), 3 (class 2)
    got = probes.knn_predict(x_train, y_train, torch.tensor([[0.9], [0.1]]), [2, 4], "l2", 3)
    assert got[2].tolist() == [0, 2] and got[4].tolist() == [0, 2]


def test_metrics_on_hand_computed_example():
    gold = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0])
    pred = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1])
    # tp=3 fn=1 fp=2 tn=2
    assert probes.accuracy(pred, gold) == pytest.approx(5 / 8)
    assert probes.f1_score(pred, gold) == pytest.approx(2 * 3 / (2 * 3 + 2 + 1))
    assert probes.matthews_corrcoef(pred, gold) == pytest.approx((3 * 2 - 2 * 1) / (5 * 4 * 4 * 3) ** 0.5)
    assert probes.matthews_corrcoef(torch.ones(4), torch.tensor([0, 1, 0, 1])) == 0.0
    assert probes.f1_score(torch.zeros(3), torch.zeros(3)) == 0.0


def test_multiclass_mcc_matches_definition():
    gold, pred = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 2, 1, 0, 0, 2])
    # c=3 correct, s=6, true counts (2,2,2), predicted counts (3,1,2)
    expected = (3 * 6 - (2 * 3 + 2 * 1 + 2 * 2)) / ((36 - (9 + 1 + 4)) * (36 - 12)) ** 0.5
    assert probes.matthews_corrcoef(pred, gold) == pytest.approx(expected)


def test_correlations_on_hand_computed_example():
    gold = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pred = torch.tensor([1.0, 3.0, 2.0, 4.0])
    assert probes.pearson(pred, gold) == pytest.approx(0.8)  # cov 4, variances 5 and 5
    assert probes.spearman(pred, gold) == pytest.approx(0.8)
    # ties share their average rank: pred ranks (1, 2.5, 2.5, 4)
    tied = torch.tensor([0.0, 7.0, 7.0, 9.0])
    assert probes.spearman(tied, gold) == pytest.approx(4.5 / (5 * 4.5) ** 0.5)
    assert probes.pearson(torch.ones(4), gold) == 0.0


def test_correlations_match_scipy():
    gen = torch.Generator().manual_seed(3)
    gold = torch.randint(0, 6, (300,), generator=gen).double()
    pred = gold + torch.randn(300, generator=gen)
    assert probes.pearson(pred, gold) == pytest.approx(scipy.stats.pearsonr(pred, gold)[0])
    assert probes.spearman(pred.round(), gold) == pytest.approx(scipy.stats.spearmanr(pred.round(), gold)[0])
