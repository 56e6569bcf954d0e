"""PS modules against real server processes: gradients equal torch's, pushes land exactly once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from itertools import count

import numpy as np
import pytest
import torch
from procs import Procs, run_in_threads
from torch import nn

from protos import modes
from protos.modes import Kind, Mode
from protos.transport import available
from worker.client import PSClient
from worker.modules import (
    PSDense,
    PSEmbedding,
    PSEmbeddingBag,
    PSModuleError,
)
from worker.optimizer import PSOptimizer, overlap_staleness
from worker.training import lookahead

_names = count()
# The shared servers apply a push at most once per (worker, incarnation, seq), and every new
# client numbers its pushes from 1: each client of a worker id needs a new incarnation.
_incarnations = count(1)


def fresh(prefix: str) -> str:
    """A table name no other test on the shared servers uses."""
    return f"{prefix}{next(_names)}"


@pytest.fixture(scope="module")
def servers(module_procs: Procs) -> str:
    """Two async shards shared by this module's tests (each test uses its own tables)."""
    return ",".join(s.address for s in module_procs.servers(2, ["--mode", "async"]))


def connect(servers: str, worker: int = 0, lanes: bool = True) -> PSClient:
    return PSClient(servers.split(","), worker=worker, incarnation=next(_incarnations),
                    lanes=lanes)


@pytest.fixture
def client(servers: str) -> Iterator[PSClient]:
    with connect(servers) as c:
        yield c


# Ids with repeats, a negative id and ids far past any vocabulary.
IDS = torch.tensor([7, 2**40 + 3, 7, -5, 123456789012, 7, -5, 0])


def loss_weights(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def check_step_moves_rows_by_minus_grad(
    client: PSClient, ps_module: PSEmbedding | PSEmbeddingBag, ids: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    local: Callable[[torch.Tensor], nn.Embedding | nn.EmbeddingBag],
) -> None:
    """With server SGD at lr 1, one step must move each row by minus torch's gradient."""
    table = ps_module.table
    keys, inverse = torch.unique(ids, return_inverse=True)
    before = client.pull_sparse(table, keys)
    reference = local(before.clone())
    out = forward(reference, inverse.view(ids.shape))
    weights = loss_weights(tuple(out.shape))
    (out * weights).sum().backward()
    expected_grad = reference.weight.grad
    assert expected_grad is not None

    ps = PSOptimizer(ps_module, overlap=False)
    ps_out = forward(ps_module, ids)
    torch.testing.assert_close(ps_out, out.detach())
    ps.zero_grad()
    (ps_out * weights).sum().backward()
    ps.step()
    after = client.pull_sparse(table, keys)
    torch.testing.assert_close(after, before - expected_grad, atol=1e-6, rtol=0)
    ps.close()


def test_embedding_gradient_equals_nn_embedding(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("emb"), 6, optimizer="sgd", lr=1.0, seed=1)
    ids = IDS.view(2, 4)  # any shape: the output is [*ids.shape, dim]
    check_step_moves_rows_by_minus_grad(
        client, emb, ids, lambda m, x: m(x),
        lambda w: nn.Embedding.from_pretrained(w, freeze=False),
    )


BAGS = {
    "sum, offsets, per-sample weights": ("sum", torch.tensor([0, 3, 3, 5]), True, IDS),
    "mean, offsets, an empty bag": ("mean", torch.tensor([0, 2, 2, 6]), False, IDS),
    "mean, 2-D fixed-length bags": ("mean", None, False, IDS.view(4, 2)),
    "max, offsets": ("max", torch.tensor([0, 4]), False, IDS),
}


@pytest.mark.parametrize("case", list(BAGS))
def test_embedding_bag_gradient_equals_nn_embedding_bag(client: PSClient, case: str) -> None:
    mode, offsets, weighted, ids = BAGS[case]
    psw = loss_weights((ids.numel(),), seed=5).view(ids.shape) if weighted else None
    bag = PSEmbeddingBag(client, fresh("bag"), 5, mode=mode, optimizer="sgd", lr=1.0)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x, offsets, per_sample_weights=psw)
        return out

    check_step_moves_rows_by_minus_grad(
        client, bag, ids, forward,
        lambda w: nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode),
    )


def test_lookups_of_one_table_in_one_step_are_summed(client: PSClient) -> None:
    # Two modules on one table (e.g. a user id and a "viewed user" id sharing rows).
    name = fresh("shared")
    a = PSEmbedding(client, name, 3, optimizer="sgd", lr=1.0)
    b = PSEmbedding(client, name, 3, optimizer="sgd", lr=1.0)
    model = nn.ModuleList([a, b])
    keys = torch.tensor([1, 2, 3])
    before = client.pull_sparse(name, keys)
    with PSOptimizer(model, overlap=False) as ps:
        (a(torch.tensor([1, 2])).sum() + 2 * b(torch.tensor([2, 3])).sum()).backward()
        ps.step()
    change = client.pull_sparse(name, keys) - before
    torch.testing.assert_close(change, -torch.tensor([[1.0], [3.0], [2.0]]).expand(3, 3))


def test_dense_round_trip_and_the_first_values_stay(client: PSClient, servers: str) -> None:
    name = fresh("mlp")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    initial = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    dense = PSDense(client, module, name, optimizer="sgd", lr=0.5)
    assert dense.numel == initial.numel()
    torch.testing.assert_close(client.pull_dense(name), initial)

    # Another worker's own (different) initial values are replaced by the servers'.
    with connect(servers, worker=1) as other:
        theirs = PSDense(other, nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)),
                         name, optimizer="sgd", lr=0.5)
        theirs.load()
        torch.testing.assert_close(
            torch.cat([p.detach().reshape(-1) for p in theirs.module.parameters()]), initial
        )

    x = loss_weights((5, 4), seed=2)
    with PSOptimizer(dense, overlap=False) as ps:
        dense(x).sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in module.parameters()])  # type: ignore[union-attr]
        ps.step()
        assert all(p.grad is None for p in module.parameters())  # sent means consumed
    trained = client.pull_dense(name)
    torch.testing.assert_close(trained, initial - 0.5 * grad, atol=1e-6, rtol=0)

    # A restarted worker (a new process: a new client and incarnation) offers its own fresh
    # initial values; the servers keep the trained ones.
    with connect(servers, worker=0) as restarted:
        again = PSDense(restarted, nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)),
                        name, optimizer="sgd", lr=0.5)
        again.load()
        torch.testing.assert_close(
            torch.cat([p.detach().reshape(-1) for p in again.module.parameters()]), trained)
    torch.testing.assert_close(client.pull_dense(name), trained)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_dense_values_reach_parameters_whose_data_was_replaced(client: PSClient) -> None:
    """A load copies the servers' values into one flat tensor the parameters view; data
    replaced since (as model.to() does) is viewed again, not left behind."""
    name = fresh("moved")
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    dense = PSDense(client, module, name, optimizer="sgd", lr=1.0)
    dense.load()
    served = client.pull_dense(name)
    torch.testing.assert_close(flat_params(module), served)
    for p in module.parameters():
        p.data = torch.zeros_like(p.data)  # elsewhere now: no longer views of the flat tensor
    client.push_dense(name, torch.ones(dense.numel))
    dense.load()
    torch.testing.assert_close(flat_params(module), served - 1.0)


def test_workers_building_one_psdense_at_once_train_from_the_same_values(servers: str) -> None:
    """Two workers with different initial values build one PSDense at the same moment, on a
    table split over both shards: each shard takes exactly one worker's rows (unmixed),
    both workers load the same values, and no flag table exists."""
    name = fresh("race")
    barrier = threading.Barrier(2)
    initial: dict[int, torch.Tensor] = {}
    loaded: dict[int, torch.Tensor] = {}

    def build(rank: int) -> None:
        torch.manual_seed(100 + rank)
        module = nn.Linear(128, 128)  # 16512 float32: over the size that splits a table
        initial[rank] = flat_params(module)
        with connect(servers, worker=rank) as c:
            barrier.wait(timeout=30)
            dense = PSDense(c, module, name, optimizer="sgd", lr=1.0)
            dense.load()
            loaded[rank] = flat_params(module)

    run_in_threads(build, 2)
    assert not torch.equal(initial[0], initial[1])
    torch.testing.assert_close(loaded[0], loaded[1], atol=0, rtol=0)
    with connect(servers) as c:
        stats = c.stats()
    blocks = [(t.row_start, t.row_end, t.pushes_applied, t.pushes_kept)
              for s in stats for t in s.tables if t.name == name]
    assert len(blocks) == 2 and all(end > start for start, end, _, _ in blocks)
    for start, end, applied, kept in blocks:
        assert (applied, kept) == (1, 1)  # one worker wrote this shard; the other was kept
        assert any(torch.equal(loaded[0][start:end], initial[r][start:end]) for r in (0, 1))
    assert not [t.name for s in stats for t in s.tables if t.name.startswith(name + ".")]


def test_a_worker_that_does_not_initialize_only_pulls(client: PSClient, servers: str) -> None:
    name = fresh("reader")
    reader = PSDense(client, nn.Linear(3, 2), name, optimizer="sgd", lr=1.0, initialize=False)
    reader.load()  # nobody wrote: the servers' own initial values
    assert torch.equal(flat_params(reader.module), torch.zeros(8))
    with connect(servers, worker=1) as other:
        module = nn.Linear(3, 2)
        PSDense(other, module, name, optimizer="sgd", lr=1.0)
        torch.testing.assert_close(client.pull_dense(name), flat_params(module))


@pytest.mark.parametrize("depth", [1, 2])
def test_overlapped_steps_push_every_gradient_exactly_once(client: PSClient, depth: int) -> None:
    """Under overlap the pushes of step t run during step t+1 and rows are prefetched
    (`depth` steps ahead, with as many exchanges in flight); with gradients that do not
    depend on the parameters, the end state is known exactly."""
    steps = 6
    emb = PSEmbedding(client, fresh("pipe"), 4, optimizer="sgd", lr=1.0)
    dense = PSDense(client, nn.Linear(8, 1), fresh("pipe_mlp"), optimizer="sgd", lr=1.0)
    model = nn.ModuleList([emb, dense])
    batches = [torch.tensor([[1, 2], [2, 3 + t]]) for t in range(steps)]
    keys = torch.arange(1, 3 + steps)
    rows_before = client.pull_sparse(emb.table, keys)
    dense_before = client.pull_dense(dense.table)
    pulls_before = table_stat(client, emb.table, "pulls")
    with PSOptimizer(model, prefetch_depth=depth) as ps:
        assert ps.overlap  # async tables
        for ids, upcoming in lookahead(batches, depth):
            if upcoming is not None:
                emb.prefetch(upcoming)
            out = dense(emb(ids).flatten(1)).sum()
            ps.zero_grad()
            out.backward()
            ps.step()
        ps.flush()
        assert client.clock == steps
    # Each step's forward used its prefetched rows: one pull per step, on each shard touched.
    assert table_stat(client, emb.table, "pulls") - pulls_before <= steps * 2
    # d out / d row = sum of the Linear weights over that slot, for every occurrence;
    # the Linear weights change every step, so compare the dense result and count rows.
    rows_after = client.pull_sparse(emb.table, keys)
    touched = torch.unique(torch.cat([b.reshape(-1) for b in batches]))
    changed = (rows_after != rows_before).any(dim=1)
    assert changed.tolist() == [bool(k in touched) for k in keys.tolist()]
    # d out / d bias = 2 per step (two samples), whatever the weights: exact after 6 steps.
    bias_after = client.pull_dense(dense.table)[-1]
    assert bias_after.item() == pytest.approx(dense_before[-1].item() - 2.0 * steps, abs=1e-5)


def test_two_prefetched_lookups_of_one_table_in_a_step(client: PSClient) -> None:
    """A step may look a table up twice (two id fields sharing one table), each prefetched;
    both lookups get their own rows and both gradients land, summed."""
    steps = 4
    emb = PSEmbedding(client, fresh("twice"), 2, optimizer="sgd", lr=1.0,
                      init=("zeros", 0, 0))
    firsts = [torch.tensor([1, 2, 3]) for _ in range(steps)]
    seconds = [torch.tensor([4, 2, 6]) for _ in range(steps)]
    with PSOptimizer(emb) as ps:
        assert ps.overlap
        batches = list(zip(firsts, seconds, strict=True))
        for (a, b), upcoming in lookahead(batches):
            if upcoming is not None:
                emb.prefetch(upcoming[0])
                emb.prefetch(upcoming[1])
            loss = emb(a).sum() + emb(b).sum()
            ps.zero_grad()
            loss.backward()
            ps.step()
        ps.flush()
    # d loss / d row = occurrences per step: id 2 twice, the others once; SGD at lr 1.
    rows = client.pull_sparse(emb.table, torch.tensor([1, 2, 3, 4, 6, 5]))
    expected = torch.tensor([1.0, 2, 1, 1, 1, 0]).unsqueeze(1) * -steps
    torch.testing.assert_close(rows, expected.expand(6, 2), atol=1e-6, rtol=0)


def table_stat(client: PSClient, table: str, field: str) -> int:
    return sum(int(getattr(t, field)) for s in client.stats() for t in s.tables if t.name == table)


def test_two_sync_workers_change_exactly_the_rows_they_touch(procs: Procs) -> None:
    """Two workers (threads with their own clients) train embeddings and a dense layer under
    sync. The gradients do not depend on the parameters, so every value is known exactly."""
    servers = [s.address for s in procs.servers(2, ["--mode", "sync", "--workers", "2"])]
    steps, dim = 3, 4
    batches = {0: torch.tensor([10, 11, 12, 10]), 1: torch.tensor([12, 13, 2**50])}
    inputs = {r: loss_weights((5, 3), seed=10 + r) for r in (0, 1)}
    probe = torch.tensor([10, 11, 12, 13, 2**50, 14, 15, -1])  # 14, 15, -1: never trained

    def declare(c: PSClient) -> None:
        c.declare_sparse("two", dim, optimizer="sgd", lr=1.0, init=("uniform", -1.0, 1.0))

    with PSClient(servers, worker=0) as c:
        declare(c)
        before = c.pull_sparse("two", probe)

    initial: dict[int, torch.Tensor] = {}

    def work(rank: int) -> None:
        with PSClient(servers, worker=rank) as c:
            torch.manual_seed(rank)  # different local initial values: the first to arrive wins
            linear = nn.Linear(3, 2)
            initial[rank] = torch.cat([linear.weight.detach().reshape(-1),
                                       linear.bias.detach()])
            model = nn.ModuleDict({
                "emb": PSEmbedding(c, "two", dim, optimizer="sgd", lr=1.0,
                                   init=("uniform", -1.0, 1.0)),
                "dense": PSDense(c, linear, "two.dense", optimizer="sgd", lr=1.0),
            })
            with PSOptimizer(model) as ps:
                assert not ps.overlap  # sync is exact: nothing overlaps
                for _ in range(steps):
                    ps.zero_grad()
                    # d/d row = its number of occurrences; d/d dense = sums of the inputs.
                    loss = model["emb"](batches[rank]).sum() + model["dense"](
                        inputs[rank]).sum()
                    loss.backward()
                    ps.step()

    run_in_threads(work, 2)
    with PSClient(servers, worker=0) as c:
        declare(c)
        c.declare_dense("two.dense", (8,), optimizer="sgd", lr=1.0)
        after = c.pull_sparse("two", probe, clock=0)
        dense_after = c.pull_dense("two.dense", clock=0)
        rows = table_stat(c, "two", "rows")
    # Sync applies the mean of the two workers' gradients once per clock.
    occurrences = {0: {10: 2, 11: 1, 12: 1}, 1: {12: 1, 13: 1, 2**50: 1}}
    for i, key in enumerate(probe.tolist()):
        per_step = (occurrences[0].get(key, 0) + occurrences[1].get(key, 0)) / 2
        torch.testing.assert_close(after[i], before[i] - steps * per_step, atol=1e-5, rtol=0)
    assert rows == len(probe)  # nothing but the probed and trained rows was created
    # Linear(3, 2) summed over a batch: d/dW[j] = column sums of x, d/db[j] = batch size.
    grads = {r: torch.cat([inputs[r].sum(0).repeat(2), torch.full((2,), 5.0)]) for r in (0, 1)}
    moved = steps * (grads[0] + grads[1]) / 2
    assert any(torch.allclose(dense_after, initial[r] - moved, atol=1e-5, rtol=0) for r in (0, 1))


def test_sync_prefetch_rides_in_the_step_and_stays_exact(procs: Procs) -> None:
    """Under sync, step() sends the pushes, the end of the iteration and the next step's
    pulls in one exchange; the prefetched rows must already include this step's update."""
    (server,) = procs.servers(1, ["--mode", "sync", "--workers", "1"])
    steps = 4
    batches = [torch.tensor([1, 2, 2, 5 + t]) for t in range(steps)]
    with PSClient([server.address], worker=0) as c:
        emb = PSEmbedding(c, "exact_pf", 3, optimizer="sgd", lr=1.0)
        dense = PSDense(c, nn.Linear(3, 1), "exact_pf.mlp", optimizer="sgd", lr=1.0)
        with PSOptimizer(nn.ModuleList([emb, dense])) as ps:
            assert not ps.overlap
            for ids, upcoming in lookahead(batches):
                if upcoming is not None:
                    emb.prefetch(upcoming)
                fresh_rows = c.pull_sparse(emb.table, ids)
                fresh_dense = c.pull_dense(dense.table)
                rows = emb(ids)
                torch.testing.assert_close(rows, fresh_rows, atol=0, rtol=0)
                out = dense(rows).sum()
                flat = torch.cat([p.detach().reshape(-1) for p in dense.module.parameters()])
                torch.testing.assert_close(flat, fresh_dense, atol=0, rtol=0)
                ps.zero_grad()
                out.backward()
                ps.step()
            assert c.clock == steps
        # Forwards pulled nothing of their own after the first step: every later step's
        # rows came in the previous step's exchange, next to the test's own fresh pulls.
        assert table_stat(c, emb.table, "pulls") == 2 * steps


def test_prefetch_depth_stays_within_the_staleness_bound(
    client: PSClient, servers: str
) -> None:
    ssp = PSEmbedding(client, fresh("deep"), 2, consistency="ssp:1")
    with pytest.raises(PSModuleError, match="past the staleness bound 1"):
        PSOptimizer(ssp, prefetch_depth=2)
    exact = PSEmbedding(client, fresh("deep"), 2, consistency="sync")
    with pytest.raises(PSModuleError, match="prefetch_depth must be 1, or more with overlap"):
        PSOptimizer(exact, prefetch_depth=2)
    PSOptimizer(ssp, prefetch_depth=1).close()
    with pytest.raises(PSModuleError, match="an int or 'auto'"):
        PSOptimizer(ssp, prefetch_depth="deep")  # type: ignore[arg-type]
    # "auto": as deep as AUTO_PREFETCH_DEPTH where every bound allows it, else shallower.
    # Over the shm exchange lanes (short round trips) the exchanges travel one at a time,
    # over gRPC as many at once as the depth.
    assert all(client.exchange_lanes()) == available("shm")[0]
    with connect(servers, lanes=False) as plain:
        assert not any(plain.exchange_lanes())
        for name, consistency, depth in (("ssp1", "ssp:1", 1), ("sync", "sync", 1),
                                         ("ssp3", "ssp:3", 2), ("async", "async", 2)):
            for c in (plain, client):
                table = PSEmbedding(c, fresh(name), 2, consistency=consistency)
                with PSOptimizer(table, prefetch_depth="auto") as ps:
                    assert ps.prefetch_depth == depth, (consistency, c.exchange_lanes())
                    lanes = all(c.exchange_lanes())
                    assert ps.in_flight == (1 if lanes else depth), (consistency, lanes)


def test_sync_tables_refuse_overlap(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("exact"), 2, consistency="sync")
    with pytest.raises(PSModuleError, match="overlap needs every table"):
        PSOptimizer(emb, overlap=True)
    with PSOptimizer(emb) as ps:
        assert not ps.overlap
        emb.prefetch(torch.tensor([1]))  # a no-op under sync, not an error


@pytest.mark.parametrize(
    ("mode", "default", "default_staleness", "stale"),
    [
        (modes.ASYNC, modes.SYNC, 5, None),  # unbounded
        (modes.SYNC, modes.ASYNC, 5, 0),  # exact reads
        (Mode(Kind.SSP, 2), modes.ASYNC, 5, 2),
        (Mode(Kind.SSP, 0), modes.ASYNC, 5, 0),
        (modes.SSP, modes.ASYNC, 5, 5),  # the servers' default bound
        (None, modes.SSP, 3, 3),  # the servers' default mode
        (None, modes.ASYNC, 3, None),
        (None, modes.SYNC, 3, 0),
    ],
)
def test_overlap_staleness(
    mode: Mode | None, default: Mode, default_staleness: int, stale: int | None
) -> None:
    assert overlap_staleness(mode, default, default_staleness) == stale


def test_a_mode_outside_the_grammar_is_refused_before_declaring(client: PSClient) -> None:
    name = fresh("badmode")
    with pytest.raises(PSModuleError, match=r"consistency='ssp:-1': unknown consistency mode"):
        PSEmbedding(client, name, 2, consistency="ssp:-1")
    with pytest.raises(PSModuleError, match=r"consistency='bsp': unknown consistency mode"):
        PSDense(client, nn.Linear(2, 1), name, consistency="bsp")
    assert name not in {t.name for t in client.stats()[0].tables}


def test_bad_inputs_get_clear_errors(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("bad"), 2)
    bag = PSEmbeddingBag(client, fresh("badbag"), 2, mode="mean")
    with pytest.raises(PSModuleError, match="int64"):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(PSModuleError, match="needs offsets"):
        bag(torch.tensor([1, 2]))
    with pytest.raises(PSModuleError, match="per_sample_weights need mode 'sum'"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(PSModuleError, match="consistency="):
        PSEmbedding(client, fresh("bad"), 2, mode="async")  # type: ignore[arg-type]
    with pytest.raises(PSModuleError, match="nothing to push"):
        PSOptimizer(nn.Linear(2, 2))
    with PSOptimizer(emb, overlap=False), pytest.raises(PSModuleError, match="another"):
        PSOptimizer(emb)


def test_inference_without_an_optimizer_records_nothing(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("infer"), 3)
    out = emb(torch.tensor([[1, 2], [3, 1]]))
    assert out.shape == (2, 2, 3) and not out.requires_grad
    empty = emb(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_and_gradients_travel_through_pinned_memory(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("gpu"), 4, optimizer="sgd", lr=1.0, device="cuda")
    linear = nn.Linear(8, 1).cuda()
    dense = PSDense(client, linear, fresh("gpu_mlp"), optimizer="sgd", lr=1.0)
    model = nn.ModuleList([emb, dense])
    ids = torch.tensor([[1, 2], [2, 3]])
    keys = torch.tensor([1, 2, 3])
    before = client.pull_sparse(emb.table, keys)
    with PSOptimizer(model) as ps:
        emb.prefetch(ids)  # rows for step 1 (this step pulls on its own)
        out = dense(emb(ids).flatten(1))
        assert out.device.type == "cuda"
        weight = linear.weight.detach().cpu().view(2, 4)
        ps.zero_grad()
        out.sum().backward()
        ps.step()
        ps.flush()
    expected = before.clone()
    expected[0] -= weight[0]  # key 1 sits in slot 0 of sample 0
    expected[1] -= weight[1] + weight[0]  # key 2: slot 1 of sample 0, slot 0 of sample 1
    expected[2] -= weight[1]
    torch.testing.assert_close(client.pull_sparse(emb.table, keys), expected, atol=1e-5, rtol=0)


def test_ids_may_be_numpy_backed_int32(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("i32"), 2)
    ids32 = torch.from_numpy(np.array([5, 6, 5], dtype=np.int32))
    torch.testing.assert_close(emb(ids32), emb(ids32.long()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_compact_table_gives_float32_outputs_and_trains(
        client: PSClient, dtype: torch.dtype) -> None:
    emb = PSEmbedding(client, fresh("half"), 4, optimizer="sgd", lr=1.0, dtype=dtype)
    bag = PSEmbeddingBag(client, fresh("halfbag"), 4, mode="sum", optimizer="sgd", lr=1.0,
                         dtype=dtype)
    ids = torch.tensor([3, 9, 3])
    before = client.pull_sparse(emb.table, torch.tensor([3, 9]))
    ps = PSOptimizer(nn.ModuleList([emb, bag]), overlap=False)
    out = emb(ids)
    pooled = bag(ids.view(1, 3))
    assert (out.dtype, pooled.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(out, before[[0, 1, 0]].float())
    ps.zero_grad()
    (out.sum() + pooled.sum()).backward()
    ps.step()  # the gradient reaches the servers in the table's dtype
    after = client.pull_sparse(emb.table, torch.tensor([3, 9]))
    assert after.dtype == dtype
    torch.testing.assert_close(after, (before.float() - torch.tensor([[2.0], [1.0]])).to(dtype))
    ps.close()


def test_an_embedding_declares_admission_and_eviction(client: PSClient) -> None:
    emb = PSEmbedding(client, fresh("admit"), 3, optimizer="sgd", lr=1.0, admit="count:2",
                      admit_default=0.25, max_rows=100, ttl_clocks=5)
    ids = torch.tensor([11, 12])
    torch.testing.assert_close(emb(ids), torch.full((2, 3), 0.25))  # first sight: no rows
    assert not torch.equal(emb(ids), torch.full((2, 3), 0.25))  # second sight: rows
    with pytest.raises(Exception, match="admit 'count:-1' is not a valid count"):
        PSEmbeddingBag(client, fresh("admit"), 3, admit="count:-1")
