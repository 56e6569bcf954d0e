"""The optimizers as served: a real cluster gives what torch.optim gives, within 1e-6."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from optim_references import NEW_CASES, reference
from procs import Procs

from ps.optim import make_optimizer
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


@pytest.mark.parametrize(("name", "hyper"), NEW_CASES, ids=str)
def test_new_rules_as_served_match_their_references(client: PSClient, name: str,
                                                    hyper: dict[str, float]) -> None:
    """Row-wise Adagrad and FTRL on a dense table split across both shards (rows are the
    first dimension) and on sparse rows, against the papers' formulas written out plainly."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(hyper.items()))
    dense = f"dense-{name}-{tag}"
    client.declare_dense(dense, (40, 6), optimizer=name, init=("uniform", -1, 1), **hyper)
    start = client.pull_dense(dense).clone()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(40, 6, generator=gen) for _ in range(STEPS)]
    for g in grads:
        client.push_dense(dense, g)
    torch.testing.assert_close(client.pull_dense(dense).double(),
                               reference(name, start, grads, hyper), atol=1e-6, rtol=0)

    sparse = f"sparse-{name}-{tag}"
    client.declare_sparse(sparse, 8, optimizer=name, seed=5, **hyper)
    keys = np.arange(30, dtype=np.int64) * 1_000_003
    rows = client.pull_sparse(sparse, keys).clone()
    history: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(keys))}
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        touched = np.sort(rng.choice(len(keys), size=12, replace=False))
        g = torch.randn(len(touched), 8, generator=gen)
        client.push_sparse(sparse, keys[touched], g)
        for j, i in enumerate(touched):
            history[int(i)].append(g[j].view(1, 8))
    got = client.pull_sparse(sparse, keys).double()
    for i in range(len(keys)):
        torch.testing.assert_close(got[i : i + 1], reference(name, rows[i : i + 1],
                                                              history[i], hyper),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_compact_rows_as_served_follow_the_float32_rule_rounded(client: PSClient,
                                                                dtype: torch.dtype) -> None:
    table = f"compact-{dtype}".replace("torch.", "")
    client.declare_sparse(table, 8, dtype=dtype, optimizer="rowwise_adagrad", lr=0.1, seed=2)
    keys = np.arange(20, dtype=np.int64) * 7_919
    rows = client.pull_sparse(table, keys)
    assert rows.dtype == dtype
    opt = make_optimizer("rowwise_adagrad", {"lr": 0.1})
    local = rows.clone()
    state = {"sum": opt.init_slot("sum", local)}
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        g = torch.randn(len(keys), 8, generator=gen).to(dtype)
        client.push_sparse(table, keys, g)
        opt.apply_rows(local, torch.arange(len(keys)), g, state, None)
    assert torch.equal(client.pull_sparse(table, keys), local)
    stats = next(t for s in client.stats() for t in s.tables if t.name == table)
    assert stats.state_bytes == stats.rows * 4  # one float32 accumulator per row
    assert stats.value_bytes == stats.rows * 8 * 2
