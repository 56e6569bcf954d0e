"""PSEmbeddingCollection against real server processes: it trains exactly as separate
tables would, while a step of many features costs one push per configuration."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count

import pytest
import torch
from procs import Procs
from torch import nn

from worker.client import PSClient
from worker.collection import (
    ID_BITS,
    MAX_FEATURES_PER_GROUP,
    FeatureConfig,
    KeyedJagged,
    Pooled,
    PSEmbeddingCollection,
)
from worker.errors import PSModuleError
from worker.modules import PSEmbedding, PSEmbeddingBag
from worker.optimizer import PSOptimizer

_names = count()
_incarnations = count(1)
DIM = 4


def fresh(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


@pytest.fixture(scope="module")
def servers(module_procs: Procs) -> str:
    """Two async shards shared by this module's tests (each test uses its own tables)."""
    return ",".join(s.address for s in module_procs.servers(2, ["--mode", "async"]))


@pytest.fixture
def client(servers: str) -> Iterator[PSClient]:
    with PSClient(servers.split(","), worker=0, incarnation=next(_incarnations)) as c:
        yield c


def feature(name: str, pooling: str = "sum", **options: object) -> FeatureConfig:
    return FeatureConfig(name, DIM, pooling=pooling, optimizer="sgd", lr=0.5,
                         init=("normal", 0.0, 0.1), **options)


def applied(client: PSClient, table: str) -> list[int]:
    """The pushes applied to `table`, per shard."""
    return [t.pushes_applied for s in client.stats() for t in s.tables if t.name == table]


def batch(step: int, size: int = 6) -> KeyedJagged:
    """Features a, b, c: one id per sample (a and b share ids, on purpose); d: a bag of
    0-3 ids per sample, ids far apart."""
    g = torch.Generator().manual_seed(step)
    single = [torch.randint(0, 20, (size,), generator=g) for _ in range(3)]
    single[1] = single[0].clone()
    lengths = torch.randint(0, 4, (size,), generator=g)
    bags = torch.randint(0, 2**40, (int(lengths.sum()),), generator=g)
    return KeyedJagged(("a", "b", "c", "d"), torch.cat([*single, bags]),
                       torch.cat([torch.ones(3 * size, dtype=torch.int64), lengths]))


class Separate(nn.Module):
    """The same four features as four separate modules over tables holding the same keys
    the collection's groups hold (slot s of a group: key s << 56 | id)."""

    def __init__(self, client: PSClient, group0: str, group1: str) -> None:
        super().__init__()
        self.group0 = PSEmbedding(client, group0, DIM, optimizer="sgd", lr=0.5,
                                  init=("normal", 0.0, 0.1))
        self.group1 = PSEmbeddingBag(client, group1, DIM, mode="mean", optimizer="sgd", lr=0.5,
                                     init=("normal", 0.0, 0.1))

    def forward(self, kjt: KeyedJagged) -> torch.Tensor:
        size = kjt.batch_size
        single = kjt.values[: 3 * size].view(3, size)
        slots = (torch.arange(3) << ID_BITS).view(3, 1)
        rows = self.group0(single | slots)  # [3, B, DIM]
        lengths = kjt.lengths[3 * size :]
        offsets = torch.cumsum(lengths, 0) - lengths
        bags = self.group1(kjt.values[3 * size :], offsets)
        return torch.cat([*rows.unbind(0), bags], dim=1)


def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + step))
    return (out * w).sum()


def test_trains_exactly_as_the_separate_tables_it_batches(client: PSClient) -> None:
    name = fresh("coll")
    collection = PSEmbeddingCollection(client, name, [
        feature("a"), feature("b"), feature("c"), feature("d", pooling="mean"),
    ])
    # Two configurations (pooling differs), so two server tables.
    assert [g.table for g in collection.groups] == [f"{name}.0", f"{name}.1"]
    reference = Separate(client, fresh("ref0."), fresh("ref1."))
    coll_ps = PSOptimizer(collection, overlap=False)
    ref_ps = PSOptimizer(reference, overlap=False)
    for step in range(5):
        kjt = batch(step)
        out = torch.cat(list(collection(kjt).values()), dim=1)
        expected = reference(kjt)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        for ps, o in ((coll_ps, out), (ref_ps, expected)):
            ps.zero_grad()
            loss_of(o, step).backward()
            ps.step()
    coll_ps.close()
    ref_ps.close()
    # One push per shard, group and step, for however many features the group holds.
    assert applied(client, f"{name}.0") == [5, 5]
    assert 0 < sum(applied(client, f"{name}.1")) <= 10


def test_a_step_of_many_features_is_one_push_per_configuration(client: PSClient) -> None:
    name = fresh("many")
    features = [feature(f"f{i}") for i in range(26)]
    collection = PSEmbeddingCollection(client, name, features)
    assert len(collection.groups) == 1
    ps = PSOptimizer(collection, overlap=False)
    ids = {f"f{i}": torch.arange(8) * (i + 1) for i in range(26)}
    for _ in range(3):
        out = collection(ids)
        assert list(out) == [f"f{i}" for i in range(26)]
        assert all(v.shape == (8, DIM) for v in out.values())
        ps.zero_grad()
        sum(v.sum() for v in out.values()).backward()
        ps.step()
    ps.close()
    assert applied(client, f"{name}.0") == [3, 3]
    # Equal ids of different features are different rows: 26 features x 8 ids.
    rows = sum(t.rows for s in client.stats() for t in s.tables if t.name == f"{name}.0")
    assert rows == 26 * 8


def test_a_prefetched_batch_is_read_once_and_served_from_the_prefetch(client: PSClient) -> None:
    collection = PSEmbeddingCollection(client, fresh("pre"), [feature("a"), feature("b")])
    ps = PSOptimizer(collection, overlap=False)
    first, second = batch(1), batch(2)
    plain = torch.cat(list(collection({"a": second.values[:6], "b": second.values[6:12]}).values()))
    ps.zero_grad()
    ps.step()
    collection(first)
    reads = []
    split = collection._split
    collection._split = lambda b: reads.append(b) or split(b)  # type: ignore[method-assign]
    collection.prefetch(second)
    keys_asked = collection._recent[id(second)][2]
    ps.zero_grad()
    ps.step()  # carries the prefetch
    group = collection.groups[0]
    ticket = ps._pipeline._ahead[id(group)][0]
    assert ticket.ids is keys_asked[0]  # the very keys, not a copy
    out = torch.cat(list(collection(second).values()))
    torch.testing.assert_close(out, plain, atol=0, rtol=0)  # nothing was pushed in between
    assert not ps._pipeline._ahead[id(group)]  # the forward took the prefetched ticket
    assert reads == [second]  # read once, for the prefetch
    ps.close()


def test_mapping_batches_take_fixed_length_bags(client: PSClient) -> None:
    collection = PSEmbeddingCollection(client, fresh("bag"), [feature("a"), feature("b")])
    ids = {"a": torch.tensor([[1, 2], [3, 3]]), "b": torch.tensor([[5, 6], [7, 8]]),
           "unused": torch.tensor([0, 0])}
    out = collection(ids)
    kjt = KeyedJagged(("a", "b"), torch.tensor([1, 2, 3, 3, 5, 6, 7, 8]),
                      torch.tensor([2, 2, 2, 2]))
    again = collection(kjt)
    for key in ("a", "b"):
        torch.testing.assert_close(out[key], again[key], atol=0, rtol=0)


@pytest.mark.parametrize(("ids", "message"), [
    ({"a": torch.tensor([1, -3]), "b": torch.tensor([1, 2])}, "feature 'a': id -3 is outside"),
    ({"a": torch.tensor([1, 2]), "b": torch.tensor([2**ID_BITS, 0])},
     f"feature 'b': id {2**ID_BITS} is outside"),
    ({"a": torch.tensor([1, 2])}, "the batch has no feature 'b'"),
    ({"a": torch.tensor([1, 2]), "b": torch.tensor([1, 2, 3])}, "the same batch size"),
    ({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0, 2.0])}, "must be int64"),
])
def test_bad_batches_are_refused_before_anything_is_sent(
    client: PSClient, ids: dict[str, torch.Tensor], message: str,
) -> None:
    name = fresh("bad")
    collection = PSEmbeddingCollection(client, name, [feature("a"), feature("b")])
    with pytest.raises(PSModuleError, match=message):
        collection(ids)
    assert sum(t.rows for s in client.stats() for t in s.tables if t.name == f"{name}.0") == 0


def test_bad_declarations_are_refused(client: PSClient) -> None:
    with pytest.raises(PSModuleError, match="names features twice: \\['a'\\]"):
        PSEmbeddingCollection(client, fresh("dup"), [feature("a"), feature("a")])
    with pytest.raises(PSModuleError, match="no features"):
        PSEmbeddingCollection(client, fresh("none"), [])
    with pytest.raises(PSModuleError, match="pooling must be one of"):
        feature("a", pooling="median")
    many = [feature(f"f{i}") for i in range(MAX_FEATURES_PER_GROUP + 1)]
    with pytest.raises(PSModuleError, match="give 'f128' another seed"):
        PSEmbeddingCollection(client, fresh("full"), many)
    # Another seed starts a second group, so 129 features fit.
    many[-1] = feature("f128", seed=1)
    assert len(PSEmbeddingCollection(client, fresh("two"), many).groups) == 2


# ---- Pooled: the forward's result, without servers -------------------------------------------


def _blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """A group of three one-id features (x, y, z) and one of a single bag feature (w), laid
    out as the groups pool them: [batch, members, dim]."""
    singles = torch.arange(2 * 3 * DIM, dtype=torch.float32).view(2, 3, DIM)
    bags = -torch.arange(2 * DIM, dtype=torch.float32).view(1, 2, DIM).transpose(0, 1)
    return singles, bags


@pytest.mark.parametrize("order", [("x", "y", "z", "w"), ("w", "x", "y", "z"),
                                   ("x", "w", "z", "y"), ("z", "y", "x", "w")])
def test_pooled_features_are_read_by_name_and_cat_in_feature_order(
    order: tuple[str, ...],
) -> None:
    singles, bags = _blocks()
    pooled = Pooled(order, [(("x", "y", "z"), singles), (("w",), bags)])
    rows = {"x": singles[:, 0], "y": singles[:, 1], "z": singles[:, 2], "w": bags[:, 0]}
    assert list(pooled) == list(order) and len(pooled) == 4
    for name in order:
        assert torch.equal(pooled[name], rows[name])
    expected = torch.cat([rows[name] for name in order], dim=1)
    assert torch.equal(pooled.cat(), expected)


def test_one_group_of_one_id_features_cats_without_a_copy() -> None:
    singles, _ = _blocks()
    together = Pooled(("x", "y", "z"), [(("x", "y", "z"), singles)]).cat()
    assert together.data_ptr() == singles.data_ptr()
    assert torch.equal(together, singles.reshape(2, 3 * DIM))


def test_a_keyed_batch_with_one_id_per_sample_reads_as_plain_ids(client: PSClient) -> None:
    """Lengths of 1 in a KeyedJagged mean what a [B] tensor means: the feature is looked up
    row by row, and the group lays its rows out sample by sample."""
    collection = PSEmbeddingCollection(client, fresh("ones"), [feature("a"), feature("b")])
    kjt = KeyedJagged(("a", "b"), torch.tensor([1, 2, 3, 4, 5, 6]),
                      torch.ones(6, dtype=torch.int64))
    split = collection._split(kjt)
    assert split.lengths == {"a": None, "b": None}
    out = collection(kjt)
    plain = collection({"a": torch.tensor([1, 2, 3]), "b": torch.tensor([4, 5, 6])})
    torch.testing.assert_close(out.cat(), plain.cat(), atol=0, rtol=0)
    assert out.cat()._base is not None  # a view of the group's [batch, features, dim] block
