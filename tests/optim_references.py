"""Plain implementations of the update rules that have no torch.optim counterpart, written
from their papers' formulas one coordinate at a time in float64: the references that
tests/ps/test_optim.py and tests/ps/test_optim_server.py hold ps/optim.py to."""

from __future__ import annotations

import math

import torch


def reference_rowwise_adagrad(w: list[list[float]], grads: list[list[list[float]]],
                              hp: dict[str, float]) -> list[list[float]]:
    """FBGEMM's exact row-wise Adagrad, one row and one coordinate at a time in float64:
    momentum[r] += sum(g[r][j]**2) / D; w[r][j] -= lr * g[r][j] / (sqrt(momentum[r]) + eps)."""
    lr, eps = hp.get("lr", 0.01), hp.get("eps", 1e-10)
    decay = hp.get("weight_decay", 0.0)
    w = [list(row) for row in w]
    momentum = [hp.get("initial_accumulator_value", 0.0)] * len(w)
    for g in grads:
        for r, row in enumerate(w):
            d = [g[r][j] + decay * row[j] for j in range(len(row))]
            momentum[r] += sum(x * x for x in d) / len(d)
            for j in range(len(row)):
                row[j] -= lr * d[j] / (math.sqrt(momentum[r]) + eps)
    return w


def reference_ftrl(w: list[float], grads: list[list[float]], hp: dict[str, float]
                   ) -> list[float]:
    """FTRL-Proximal, Algorithm 1 of McMahan et al. (2013), per coordinate in float64, with
    the weights starting at `w` (the sigma * w term carries them)."""
    alpha, beta = hp.get("lr", 0.1), hp.get("beta", 1.0)
    l1, l2 = hp.get("l1", 0.0), hp.get("l2", 0.0)
    w = list(w)
    z = [0.0] * len(w)
    n = [hp.get("initial_accumulator_value", 0.0)] * len(w)
    for g in grads:
        for i in range(len(w)):
            sigma = (math.sqrt(n[i] + g[i] * g[i]) - math.sqrt(n[i])) / alpha
            z[i] += g[i] - sigma * w[i]
            n[i] += g[i] * g[i]
            if abs(z[i]) <= l1:
                w[i] = 0.0
            else:
                sign = 1.0 if z[i] > 0 else -1.0
                w[i] = -(z[i] - sign * l1) / ((beta + math.sqrt(n[i])) / alpha + l2)
    return w


NEW_CASES = [
    ("rowwise_adagrad", {"lr": 0.1}),
    ("rowwise_adagrad", {"lr": 0.05, "eps": 1e-6, "weight_decay": 0.01,
                         "initial_accumulator_value": 0.1}),
    ("ftrl", {"lr": 0.1}),
    ("ftrl", {"lr": 0.05, "beta": 0.5, "l1": 0.3, "l2": 0.2}),
    ("ftrl", {"lr": 0.2, "beta": 0.0, "l1": 1.0, "initial_accumulator_value": 0.1}),
]


def reference(name: str, start: torch.Tensor, grads: list[torch.Tensor],
              hp: dict[str, float]) -> torch.Tensor:
    """`start` after `grads` under rule `name` (rows: the first dimension)."""
    rows = start.reshape(start.shape[0], -1).double()
    steps = [g.reshape(rows.shape).double() for g in grads]
    if name == "rowwise_adagrad":
        out = reference_rowwise_adagrad(rows.tolist(), [g.tolist() for g in steps], hp)
        return torch.tensor(out, dtype=torch.float64).reshape(start.shape)
    flat = reference_ftrl(rows.flatten().tolist(), [g.flatten().tolist() for g in steps], hp)
    return torch.tensor(flat, dtype=torch.float64).reshape(start.shape)
