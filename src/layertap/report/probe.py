"""Linear probes: how well a layer's features tell the classes apart, as one number per layer.

A probe is a multinomial logistic regression trained on the features to predict the class. Its
cross-validated accuracy ranks layers by how linearly their features hold the class: in a
trained classifier it rises with depth. It is solved here, in float64 torch, by a short L-BFGS
(`minimise`), so layertap needs no scikit-learn, and torch's own optimisers are not imported:
building one imports TorchDynamo, a second of start-up. The tests check the probes against
scikit-learn's ``LogisticRegression``.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> y = np.arange(60) % 3
>>> noise = rng.normal(size=(60, 4))
>>> linear_probe(noise + 2 * np.eye(3, 4)[y], y).accuracy     # the classes 2 std apart along 3 axes
0.9166666666666666
>>> linear_probe(noise, y).accuracy, linear_probe(noise, y).chance   # no class in the features
(0.4, 0.3333333333333333)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ArgumentError
from .projection import one_thread


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The cross-validated accuracy of a linear probe.

    Attributes:
        accuracy: the share of samples predicted right when held out (all folds together).
        fold_accuracy: the accuracy on each fold's held-out samples.
        folds: the fold of each sample (stratified: each class spread evenly over the folds).
        chance: the share of the most common class, what always guessing it scores.
    """

    accuracy: float
    fold_accuracy: tuple[float, ...]
    folds: np.ndarray
    chance: float


def stratified_folds(y: np.ndarray, folds: int, seed: int = 0) -> np.ndarray:
    """The fold (``0 .. folds-1``) of each sample: every class dealt out in turn, in a seeded
    random order, so that each fold holds each class in the same proportion, to one sample."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), dtype=np.int64)
    dealt = 0
    for k in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == k))
        fold[members] = (dealt + np.arange(len(members))) % folds  # the next class starts where this one stopped
        dealt += len(members)
    return fold


def minimise(
    f: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, *, history: int = 10, tolerance: float = 1e-6, iterations: int = 1000
) -> torch.Tensor:
    """The minimum of a smooth convex ``f`` (returning its value and gradient) from ``x``, by
    L-BFGS with a backtracking (Armijo) line search; stops when no gradient entry exceeds
    ``tolerance`` or the value no longer changes."""
    value, grad = f(x)
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (s, y, 1 / y.s)
    for _ in range(iterations):
        if float(grad.abs().max()) <= tolerance:
            break
        direction = -grad  # the two-loop recursion: the inverse Hessian estimate times -grad
        alphas = []
        for s, y, rho in reversed(steps):
            alpha = rho * (s @ direction)
            direction = direction - alpha * y
            alphas.append(alpha)
        if steps:
            s, y, _ = steps[-1]
            direction = direction * ((s @ y) / (y @ y))
        for (s, y, rho), alpha in zip(steps, reversed(alphas)):
            direction = direction + (alpha - rho * (y @ direction)) * s
        slope = float(grad @ direction)
        step = 1.0
        while True:
            moved = x + step * direction
            new_value, new_grad = f(moved)
            if float(new_value) <= float(value) + 1e-4 * step * slope or step < 1e-12:
                break
            step /= 2
        s, y = moved - x, new_grad - grad
        if float(s @ y) > 1e-12:  # curvature seen: worth remembering
            steps = [*steps[-history + 1 :], (s, y, 1 / (s @ y))]
        change = abs(float(value) - float(new_value))
        x, value, grad = moved, new_value, new_grad
        if change <= 1e-14 * max(1.0, abs(float(value))):
            break
    return x


def fit_logistic(x: np.ndarray, y: np.ndarray, classes: int, l2: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[D, classes]`` and biases of a multinomial logistic regression minimising
    ``sum(cross-entropy) + l2 / 2 * |W|^2``: scikit-learn's objective with ``C = 1 / l2``
    (biases are not penalised)."""
    features = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    n, width = features.shape
    onehot = torch.nn.functional.one_hot(torch.from_numpy(np.asarray(y, dtype=np.int64)), classes).double()

    def loss(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective over n (the same minimum; tolerances that mean the same at any n) and its gradient."""
        weight, bias = theta[: width * classes].view(width, classes), theta[width * classes :]
        logits = features @ weight + bias
        log_p = logits.log_softmax(1)
        value = -(onehot * log_p).sum() / n + l2 / (2 * n) * weight.square().sum()
        error = (log_p.exp() - onehot) / n
        return value, torch.cat([(features.T @ error + l2 / n * weight).reshape(-1), error.sum(0)])

    theta = minimise(loss, torch.zeros(width * classes + classes, dtype=torch.float64))
    return theta[: width * classes].view(width, classes), theta[width * classes :]


def linear_probe(x: np.ndarray, y: np.ndarray, *, folds: int = 5, l2: float = 1.0, seed: int = 0) -> ProbeResult:
    """Cross-validated accuracy of a logistic regression predicting ``y`` from ``x`` (``[N, D]``).

    Each of ``folds`` stratified folds is held out in turn; the features are standardised with
    the other folds' mean and std, and the probe (`fit_logistic`, L2 penalty ``l2``) is trained
    on them.
    """
    x = np.asarray(x, dtype=np.float64)
    names, y = np.unique(np.asarray(y), return_inverse=True)
    if x.ndim != 2 or len(x) != len(y):
        raise ArgumentError(f"a probe needs features [N, D] and N labels, got {list(x.shape)} and {len(y)}")
    if len(names) < 2 or folds < 2 or len(y) < folds:
        raise ArgumentError(f"a probe needs 2 classes or more and at least {folds} samples, got {len(names)} and {len(y)}")
    fold = stratified_folds(y, folds, seed)
    right = np.zeros(len(y), dtype=bool)
    with one_thread():
        for f in range(folds):
            train, test = fold != f, fold == f
            mean, std = x[train].mean(0), x[train].std(0)
            std[std == 0] = 1.0  # a constant feature stays 0
            weight, bias = fit_logistic((x[train] - mean) / std, y[train], len(names), l2)
            scores = torch.from_numpy((x[test] - mean) / std) @ weight + bias
            right[test] = scores.argmax(1).numpy() == y[test]
    per_fold = tuple(float(right[fold == f].mean()) for f in range(folds))
    return ProbeResult(float(right.mean()), per_fold, fold, float(np.bincount(y).max() / len(y)))


__all__ = ["ProbeResult", "fit_logistic", "linear_probe", "minimise", "stratified_folds"]
