"""The serving loader: lookups by id against nn.Embedding(Bag) on the same rows, unknown ids,
dense modules in PSDense's order, and deltas applied to an export."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protos.exported import (
    MANIFEST_NAME,
    DenseTable,
    Export,
    ExportFormatError,
    SparseTable,
    read_export,
    sha256_file,
    write_export,
)
from ps.export import delta
from worker import serving
from worker.serving import ServingEmbedding, ServingEmbeddingBag, apply_delta, load_dense

REPO = Path(__file__).resolve().parents[2]
KEYS = torch.tensor([-7, 0, 3, 10, 1 << 50])


def table(dtype: torch.dtype = torch.float32, dim: int = 4, keys: torch.Tensor = KEYS,
          default: float = 0.0) -> SparseTable:
    values = (torch.arange(len(keys) * dim, dtype=torch.float32).reshape(len(keys), dim) + 1)
    return SparseTable(keys, values.to(dtype), torch.full((dim,), default, dtype=dtype))


def dense_of(t: SparseTable, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same lookup as an nn.Embedding weight: row i for KEYS[i], the last for others."""
    weight = torch.cat([t.values, t.default.view(1, -1)])
    index = torch.tensor([t.keys.tolist().index(i) if i in t.keys.tolist() else len(t.keys)
                          for i in ids.reshape(-1).tolist()]).view(ids.shape)
    return weight, index


def test_an_embedding_finds_each_id_and_serves_the_default_row_for_unknown_ones() -> None:
    t = table(default=-1.0)
    ids = torch.tensor([[3, 11, -7], [1 << 50, -8, 1 << 60]])
    weight, index = dense_of(t, ids)
    got = ServingEmbedding(t)(ids)
    assert got.shape == (2, 3, 4)
    assert torch.equal(got, F.embedding(index, weight))
    assert torch.equal(got[0, 1], torch.full((4,), -1.0))  # 11 is not held
    empty = ServingEmbedding(SparseTable(torch.empty(0, dtype=torch.int64),
                                         torch.empty(0, 2), torch.zeros(2)))
    assert torch.equal(empty(torch.tensor([1, 2])), torch.zeros(2, 2))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_bag_pools_as_nn_embedding_bag_on_the_same_rows(mode: str) -> None:
    t = table()
    ids = torch.tensor([3, 0, 99, 10, -7, 1 << 50, 3])
    offsets = torch.tensor([0, 3, 3, 5])  # a bag of three, an empty one, two, two
    weight, index = dense_of(t, ids)
    expected = F.embedding_bag(index, weight, offsets, mode=mode)
    assert torch.equal(ServingEmbeddingBag(t, mode)(ids, offsets), expected)
    fixed = ids[:6].view(3, 2)
    assert torch.equal(ServingEmbeddingBag(t, mode)(fixed),
                       F.embedding_bag(index[:6].view(3, 2), weight, mode=mode))
    if mode == "sum":
        w = torch.rand(len(ids))
        assert torch.equal(ServingEmbeddingBag(t, mode)(ids, offsets, per_sample_weights=w),
                           F.embedding_bag(index, weight, offsets, mode=mode,
                                           per_sample_weights=w))


def test_half_precision_tables_are_served_in_their_dtype() -> None:
    t = table(torch.bfloat16)
    assert ServingEmbedding(t)(torch.tensor([3])).dtype == torch.bfloat16
    assert torch.equal(ServingEmbedding(t)(torch.tensor([3]))[0], t.values[2])


def test_load_dense_fills_trainable_parameters_in_psdense_order() -> None:
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    trained[0].bias.requires_grad_(False)  # stays local in PSDense: not in the table
    flat = torch.cat([p.detach().reshape(-1) for p in serving.trainable_parameters(trained)])
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    fresh[0].bias.requires_grad_(False)
    load_dense(fresh, DenseTable(flat))
    for a, b in zip(trained.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b) != (a is trained[0].bias)
    with pytest.raises(ExportFormatError, match="holds 10 values, the module's trainable "
                                                "parameters 6"):
        load_dense(nn.Linear(5, 1), DenseTable(torch.zeros(10)))


def _export(checkpoint_id: str, tables: dict[str, SparseTable | DenseTable]) -> Export:
    return Export(job="j", checkpoint_id=checkpoint_id, clock=int(checkpoint_id[1:]),
                  tables=tables)


def test_a_delta_applied_to_its_base_gives_the_next_export_bit_for_bit(tmp_path: Path) -> None:
    a = _export("c1", {
        "emb": table(keys=torch.tensor([1, 2, 3, 4])),
        "half": table(torch.bfloat16, dim=2),
        "mlp": DenseTable(torch.arange(6.0).reshape(2, 3)),
        "gone": DenseTable(torch.zeros(2)),
        "same": DenseTable(torch.ones(2)),
    })
    emb = table(keys=torch.tensor([1, 3, 4, 9]))
    emb.values[1] = torch.tensor([-0.0, float("nan"), 5.0, 6.0])  # key 3 changes; 4 keeps
    emb.values[2] = a.tables["emb"].values[3]  # type: ignore[union-attr]
    b = _export("c2", {
        "emb": emb,
        "half": table(torch.bfloat16, dim=2),
        "mlp": DenseTable(torch.arange(6.0).reshape(2, 3) * 2),
        "same": DenseTable(torch.ones(2)),
        "new": table(keys=torch.tensor([5])),
    })
    write_export(tmp_path / "a", a)
    write_export(tmp_path / "b", b)
    d = delta(a, b, sha256_file(tmp_path / "a" / MANIFEST_NAME))
    changed = d.tables["emb"]
    assert isinstance(changed, SparseTable)
    assert changed.keys.tolist() == [3, 9] and changed.removed.tolist() == [2]
    assert set(d.tables) == {"emb", "half", "mlp", "new"} and d.dropped_tables == ("gone",)
    write_export(tmp_path / "d", d)
    # Through the files: the delta checks its base, and the result writes B's very bytes.
    serving.save(tmp_path / "b2", apply_delta(tmp_path / "a", tmp_path / "d"))
    for name in sorted(p.name for p in (tmp_path / "b").iterdir()):
        assert sha256_file(tmp_path / "b2" / name) == sha256_file(tmp_path / "b" / name), name
    assert sorted(p.name for p in (tmp_path / "b2").iterdir()) == sorted(
        p.name for p in (tmp_path / "b").iterdir())
    got = read_export(tmp_path / "b2")
    assert torch.equal(got.tables["emb"].values.view(torch.int32),  # type: ignore[union-attr]
                       emb.values.view(torch.int32))


def test_a_delta_refuses_another_base(tmp_path: Path) -> None:
    write_export(tmp_path / "a", _export("c1", {"t": DenseTable(torch.zeros(2))}))
    write_export(tmp_path / "other", _export("c1", {"t": DenseTable(torch.ones(2))}))
    b = _export("c2", {"t": DenseTable(torch.ones(2))})
    write_export(tmp_path / "d", delta(read_export(tmp_path / "a"), b,
                                       sha256_file(tmp_path / "a" / MANIFEST_NAME)))
    with pytest.raises(ExportFormatError, match="the delta was made against export"):
        apply_delta(tmp_path / "other", tmp_path / "d")
    with pytest.raises(ExportFormatError, match="needs a full export and a delta"):
        apply_delta(tmp_path / "d", tmp_path / "d")


def test_the_loader_imports_only_torch_safetensors_the_format_and_the_standard_library() -> None:
    tree = ast.parse((REPO / "worker" / "serving.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    assert {m.split(".")[0] for m in found} <= {"__future__", "pathlib", "torch", "protos"}
    assert {m for m in found if m.startswith("protos")} == {"protos.exported"}
