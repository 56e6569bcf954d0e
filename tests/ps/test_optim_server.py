"""The optimizers as served: a real cluster gives what torch.optim gives, within 1e-6."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from procs import Procs

from worker.client import PSClient

STEPS = 10
CASES = [
    ("sgd", {"lr": 0.1}, lambda p, h: torch.optim.SGD(p, lr=h["lr"])),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01},
     lambda p, h: torch.optim.SGD(p, lr=h["lr"], weight_decay=h["weight_decay"])),
    ("adagrad", {"lr": 0.1}, lambda p, h: torch.optim.Adagrad(p, lr=h["lr"])),
    ("adam", {"lr": 0.01}, lambda p, h: torch.optim.Adam(p, lr=h["lr"], foreach=False)),
    ("adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6},
     lambda p, h: torch.optim.Adam(p, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                   foreach=False)),
]


@pytest.fixture(scope="module")
def client(module_procs: Procs) -> Iterator[PSClient]:
    servers = module_procs.servers(2)
    with PSClient([s.address for s in servers]) as c:
        yield c


@pytest.mark.parametrize(("name", "hyper", "make"), CASES)
def test_dense_matches_torch_optim(client: PSClient, name: str, hyper: dict[str, float],
                                   make: object) -> None:
    table = f"dense-{name}-{len(hyper)}"
    # 200 x 100 float32 = 80 KiB: split across both shards.
    client.declare_dense(table, (200, 100), optimizer=name, init=("uniform", -1, 1), **hyper)
    param = client.pull_dense(table).clone().requires_grad_(True)
    opt = make([param], hyper)  # type: ignore[operator]
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        g = torch.randn(200, 100, generator=gen)
        client.push_dense(table, g)
        param.grad = g.clone()
        opt.step()
    torch.testing.assert_close(client.pull_dense(table), param.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "hyper", "make"), CASES)
def test_sparse_rows_match_torch_optim(client: PSClient, name: str, hyper: dict[str, float],
                                       make: object) -> None:
    table = f"sparse-{name}-{len(hyper)}"
    client.declare_sparse(table, 8, optimizer=name, seed=5, **hyper)
    keys = np.arange(40, dtype=np.int64) * 1_000_003
    start = client.pull_sparse(table, keys)
    # One torch parameter per row, stepped only when its row is pushed: a row's state
    # depends on its own history alone.
    params = [start[i].clone().requires_grad_(True) for i in range(len(keys))]
    opts = [make([p], hyper) for p in params]  # type: ignore[operator]
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        touched = np.sort(rng.choice(len(keys), size=15, replace=False))
        g = torch.randn(len(touched), 8, generator=gen)
        client.push_sparse(table, keys[touched], g)
        for j, i in enumerate(touched):
            params[i].grad = g[j].clone()
            opts[i].step()
    expected = torch.stack([p.detach() for p in params])
    torch.testing.assert_close(client.pull_sparse(table, keys), expected, atol=1e-6, rtol=0)
