"""`PSEmbeddingCollection`: many sparse features in one module, looked up as few tables.

A click model has dozens of sparse features (Criteo has 26). Declared as one PSEmbedding
each, every step pays per table: a unique, a pull and a push entry, a leaf tensor and an
optimizer call on the server, per feature. The collection batches them as table-batched
embeddings do: features that share a configuration (width, pooling, optimizer and its
hyperparameters, initialiser, seed, dtype, mode) form one group, and a group is one
server table. Each feature of a group owns a key namespace in it: feature slot s holds id
x at key `s << 56 | x`, so a step's ids of every feature of a group travel as one key
array, are de-duplicated, pulled and pushed once, and the server looks them up and applies
their gradients in one call. A collection of 26 features of one configuration costs about
what one table with their rows costs.

Ids must lie in [0, 2**56); a group holds at most 128 features. Slot 0's keys are its raw
ids, so a one-feature group's table reads like a PSEmbedding's.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.client import PSClient
from worker.errors import PSModuleError
from worker.modules import Init, _SparseLookup

__all__ = ["FeatureConfig", "KeyedJagged", "PSEmbeddingCollection", "Pooled"]

ID_BITS = 56
MAX_ID = (1 << ID_BITS) - 1
MAX_FEATURES_PER_GROUP = 128  # slots 0..127 keep every key non-negative
_POOLINGS = ("sum", "mean", "max")
_RECENT_BATCHES = 8  # more than any prefetch depth


@dataclass(frozen=True)
class FeatureConfig:
    """One sparse feature of a collection: its rows' width, how a sample's ids are pooled
    ("sum", "mean", "max"; a single id pools to its own row), and its table's options as
    PSEmbedding takes them. Features with equal options share one server table."""

    name: str
    embedding_dim: int
    pooling: str = "sum"
    optimizer: str = "adagrad"
    lr: float = 0.01
    init: Init = ("uniform", -0.05, 0.05)
    seed: int = 0
    consistency: str = ""
    dtype: torch.dtype = torch.float32
    hyper: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise PSModuleError("a feature needs a non-empty name")
        if self.embedding_dim < 1:
            raise PSModuleError(
                f"feature {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}"
            )
        if self.pooling not in _POOLINGS:
            raise PSModuleError(
                f"feature {self.name!r}: pooling must be one of {_POOLINGS}, got {self.pooling!r}"
            )

    def group_key(self) -> tuple[object, ...]:
        """What features must share to share a table."""
        return (self.embedding_dim, self.pooling, self.optimizer, self.lr, self.init,
                self.seed, self.consistency, self.dtype, tuple(sorted(self.hyper.items())))


@dataclass(frozen=True)
class KeyedJagged:
    """A batch of variable-length id lists for several features, laid out as TorchRec's
    KeyedJaggedTensor: `values` holds every id, feature by feature and, within a feature,
    sample by sample; `lengths` (len(keys) * batch) says how many ids each (feature, sample)
    has. A sample with no id of a feature pools to zeros."""

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // max(len(self.keys), 1)


@dataclass(frozen=True)
class _Member:
    name: str
    slot: int


@dataclass(frozen=True)
class _Split:
    """A batch as the collection reads it: every id in one flat int64 CPU tensor, each
    feature's span in it, and its ids per sample (None: exactly one each, whether given as
    [B], [B, 1] or a KeyedJagged's lengths of 1)."""

    values: torch.Tensor
    spans: dict[str, tuple[int, int]]
    lengths: dict[str, torch.Tensor | None]
    batch: int


class _Group(_SparseLookup):
    """One server table holding the features of one configuration, each in its own slot."""

    def __init__(self, client: PSClient, table: str, config: FeatureConfig,
                 device: torch.device | str | None) -> None:
        super().__init__(
            client, table, config.embedding_dim, optimizer=config.optimizer, lr=config.lr,
            init=config.init, seed=config.seed, mode=config.consistency, dtype=config.dtype,
            device=device, hyper=dict(config.hyper),
        )
        self.pooling = config.pooling
        self.members: list[_Member] = []
        self._slots = torch.empty(0, dtype=torch.int64)

    def add(self, name: str) -> None:
        self.members.append(_Member(name, len(self.members)))
        self._slots = torch.arange(len(self.members), dtype=torch.int64) << ID_BITS

    def _singles(self, split: _Split) -> bool:
        """Whether every member has exactly one id per sample in `split`."""
        return all(split.lengths[m.name] is None for m in self.members)

    def keys(self, split: _Split) -> torch.Tensor:
        """Every member's ids, namespaced by its slot, as one flat int64 CPU tensor."""
        spans = [split.spans[m.name] for m in self.members]
        contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        ids = (split.values[spans[0][0] : spans[-1][1]] if contiguous
               else torch.cat([split.values[a:b] for a, b in spans]))
        if len(self.members) == 1:
            return ids
        if self._singles(split):
            # One op for the common case: a [features, batch] view OR its slots' column.
            return (ids.view(len(self.members), split.batch) | self._slots.view(-1, 1)).view(-1)
        totals = torch.tensor([b - a for a, b in spans], dtype=torch.int64)
        return ids | torch.repeat_interleave(self._slots, totals)

    def pool(self, split: _Split, keys: torch.Tensor) -> torch.Tensor:
        """The members' pooled rows, [batch, members, dim] (member i's: `[:, i]`); `keys`
        as keys() made them of `split`."""
        inverse, rows = self._lookup(keys)
        batch, count = split.batch, len(self.members)
        if self._singles(split):
            # One id per sample: pooling is the row itself, looked up sample by sample so
            # a sample's rows lie side by side (as a fused table's [batch, features] would).
            return F.embedding(inverse.view(count, batch).t(), rows)
        ones = torch.ones(batch, dtype=torch.int64)
        counts = torch.cat([ones if (n := split.lengths[m.name]) is None else n
                            for m in self.members])
        offsets = torch.zeros_like(counts)
        torch.cumsum(counts[:-1], 0, out=offsets[1:])
        pooled = F.embedding_bag(inverse, rows, offsets.to(inverse.device), mode=self.pooling)
        return pooled.view(count, batch, -1).transpose(0, 1)


class Pooled(Mapping[str, torch.Tensor]):
    """What a collection's forward returns: each feature's pooled rows, [B, embedding_dim],
    by name, in the collection's feature order (a read-only mapping). `cat()` gives them
    side by side, as `torch.cat(list(pooled.values()), dim=1)` would, from the groups'
    blocks: one copy of the rows, or none for a single group's features of one id each."""

    def __init__(self, order: tuple[str, ...],
                 blocks: Sequence[tuple[tuple[str, ...], torch.Tensor]]) -> None:
        self._order = order
        # Each group's members and their rows, [batch, members, dim].
        self._blocks = blocks
        self._features: dict[str, torch.Tensor] | None = None

    def _by_name(self) -> dict[str, torch.Tensor]:
        if self._features is None:  # made on first use: cat() needs none of them
            features: dict[str, torch.Tensor] = {}
            for names, block in self._blocks:
                features.update(zip(names, block.unbind(1), strict=True))
            self._features = {name: features[name] for name in self._order}
        return self._features

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._by_name()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def cat(self) -> torch.Tensor:
        """Every feature's rows side by side, [B, sum of embedding_dim], in feature order."""
        pieces: list[torch.Tensor] = []
        at = 0
        starting = {names[0]: (names, block) for names, block in self._blocks}
        while at < len(self._order):
            group = starting.get(self._order[at])
            if group is not None and self._order[at : at + len(group[0])] == group[0]:
                pieces.append(group[1].flatten(1))  # a view when its members lie side by side
                at += len(group[0])
            else:
                pieces.append(self[self._order[at]])
                at += 1
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


class PSEmbeddingCollection(nn.Module):
    """Many sparse features in one module, like TorchRec's EmbeddingBagCollection, over
    server tables batched by configuration (see the module docstring).

    `forward(batch)` takes a `KeyedJagged` or a mapping of feature name to ids ([B] or
    [B, L]; extra names are ignored, missing ones raise PSModuleError) and returns each
    feature's pooled rows, [B, embedding_dim], by name, in the collection's feature order
    (a `Pooled`; its `cat()` puts them side by side with the fewest copies).
    `prefetch(batch)` asks for the rows a later forward on the same batch will need, as
    PSEmbedding.prefetch does. Construction declares one table per group, named
    `{name}.{i}` in order of first appearance (blocks on every shard); adding, removing or
    reordering features can change the grouping, and so the tables. Gradients are recorded
    and pushed as for PSEmbedding: a PSOptimizer over a model holding the collection finds
    its groups. Not thread-safe.
    """

    def __init__(self, client: PSClient, name: str, features: Sequence[FeatureConfig], *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not name:
            raise PSModuleError("a collection needs a non-empty name")
        if not features:
            raise PSModuleError(f"collection {name!r} has no features")
        names = [f.name for f in features]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise PSModuleError(f"collection {name!r} names features twice: {repeated}")
        self.name = name
        self.features = tuple(features)
        groups: dict[tuple[object, ...], _Group] = {}
        for config in features:
            group = groups.get(config.group_key())
            if group is None:
                group = _Group(client, f"{name}.{len(groups)}", config, device)
                groups[config.group_key()] = group
            if len(group.members) == MAX_FEATURES_PER_GROUP:
                raise PSModuleError(
                    f"collection {name!r}: more than {MAX_FEATURES_PER_GROUP} features share "
                    f"one configuration; give {config.name!r} another seed to start a group"
                )
            group.add(config.name)
        self._groups = list(groups.values())
        self._names = tuple(f.name for f in self.features)
        self._member_names = [tuple(m.name for m in g.members) for g in self._groups]
        # The last batches read, by identity: a prefetched batch is read once.
        self._recent: OrderedDict[int, tuple[KeyedJagged, _Split, list[torch.Tensor]]] = (
            OrderedDict())
        self.groups = nn.ModuleList(self._groups)  # registered, so PSOptimizer finds them

    def _split(self, batch: KeyedJagged | Mapping[str, torch.Tensor]) -> _Split:
        """Reads `batch` (see forward); checks names, dtypes and id ranges."""
        if isinstance(batch, KeyedJagged):
            names, values = batch.keys, batch.values.reshape(-1)
            size = batch.batch_size
            counts = batch.lengths.to("cpu", torch.int64).view(len(names), size)
            host = counts.numpy()
            totals = host.sum(1).tolist()
            # A feature with one id per sample is looked up, not pooled (see _Group.pool).
            per_sample: list[torch.Tensor | None] = [
                None if single else counts[i]
                for i, single in enumerate((host == 1).all(1).tolist())
            ]
        else:
            names = tuple(batch)
            sizes = {t.shape[0] for t in batch.values() if t.dim() > 0}
            if len(sizes) != 1:
                raise PSModuleError(f"collection {self.name!r}: every feature needs the same "
                                    f"batch size, got {sorted(sizes)}")
            (size,) = sizes
            per_sample, totals = [], []
            for t in batch.values():
                # [B] and [B, 1] alike: one id per sample, looked up, not pooled.
                per_sample.append(None if t.dim() == 1 or t.shape[1] == 1
                                  else torch.full((size,), t.shape[1], dtype=torch.int64))
                totals.append(t.numel())
            values = torch.cat([t.reshape(-1) for t in batch.values()])
        missing = [f.name for f in self.features if f.name not in names]
        if missing:
            raise PSModuleError(f"collection {self.name!r}: the batch has no feature "
                                f"{missing[0]!r} (it has {sorted(names)})")
        if values.dtype not in (torch.int64, torch.int32):
            raise PSModuleError(f"collection {self.name!r}: ids must be int64 (or int32), "
                                f"got {values.dtype}")
        values = values.detach().to(device="cpu", dtype=torch.int64)
        spans: dict[str, tuple[int, int]] = {}
        lengths: dict[str, torch.Tensor | None] = {}
        start = 0
        for name, total, n in zip(names, totals, per_sample, strict=True):
            spans[name], lengths[name] = (start, start + total), n
            start += total
        # As unsigned, a negative id is above MAX_ID too: one pass finds both.
        if values.numel() and int(values.numpy().view(np.uint64).max()) > MAX_ID:
            where = int(((values < 0) | (values > MAX_ID)).nonzero()[0])
            bad = int(values[where])
            feature = next(n for n, (a, b) in spans.items() if a <= where < b)
            raise PSModuleError(f"feature {feature!r}: id {bad} is outside "
                                f"[0, 2**{ID_BITS}); hash larger ids into that range")
        return _Split(values, spans, lengths, size)

    def _read(self, batch: KeyedJagged | Mapping[str, torch.Tensor]) -> tuple[
        _Split, list[torch.Tensor]
    ]:
        """The batch's split and each group's keys; a KeyedJagged read lately (prefetched)
        is not read again, and its keys are the very tensors its pulls were asked with."""
        if isinstance(batch, KeyedJagged):
            recent = self._recent.get(id(batch))
            if recent is not None and recent[0] is batch:
                return recent[1], recent[2]
        split = self._split(batch)
        keys = [group.keys(split) for group in self._groups]
        if isinstance(batch, KeyedJagged):
            self._recent[id(batch)] = (batch, split, keys)
            while len(self._recent) > _RECENT_BATCHES:
                self._recent.popitem(last=False)
        return split, keys

    def prefetch(self, batch: KeyedJagged | Mapping[str, torch.Tensor]) -> None:
        """Asks ahead for the rows a forward on `batch` will need. Returns at once. A
        KeyedJagged must not change between its prefetch and its forward."""
        _, keys = self._read(batch)
        for group, group_keys in zip(self._groups, keys, strict=True):
            group.ask_ahead(group_keys)

    def forward(self, batch: KeyedJagged | Mapping[str, torch.Tensor]) -> Pooled:
        split, keys = self._read(batch)
        return Pooled(self._names, [
            (names, group.pool(split, group_keys))
            for group, names, group_keys in zip(self._groups, self._member_names, keys,
                                                strict=True)
        ])

    def extra_repr(self) -> str:
        return f"name={self.name!r}, features={len(self.features)}, tables={len(self.groups)}"
