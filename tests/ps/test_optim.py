"""ps.optim against torch.optim: dense blocks, per-row sparse updates, validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from optim_references import NEW_CASES, reference

import ps.optim
import ps.rows
from ps.errors import InvalidArgumentError
from ps.optim import (
    OPTIMIZERS,
    SGD,
    Adagrad,
    AdagradConfig,
    Adam,
    AdamConfig,
    Optimizer,
    SGDConfig,
    make_optimizer,
)

ATOL = 1e-6
STEPS = 10
CAPACITY, DIM = 50, 8


def _torch_sgd(p: torch.Tensor, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p], foreach=False, **hp)


def _torch_adagrad(p: torch.Tensor, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad([p], lr_decay=0, foreach=False, **hp)


def _torch_adam(p: torch.Tensor, hp: dict[str, Any]) -> torch.optim.Optimizer:
    hp = dict(hp)
    betas = (hp.pop("beta1", 0.9), hp.pop("beta2", 0.999))
    return torch.optim.Adam([p], betas=betas, amsgrad=False, maximize=False, foreach=False, **hp)


REFERENCE: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.optim.Optimizer]] = {
    "sgd": _torch_sgd,
    "adagrad": _torch_adagrad,
    "adam": _torch_adam,
}

# (optimizer name, hyperparameters named as in its config); each with and without decay.
CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.05}),
    ("adagrad", {"lr": 0.1}),
    (
        "adagrad",
        {"lr": 0.1, "weight_decay": 0.05, "initial_accumulator_value": 0.1, "eps": 1e-6},
    ),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}),
]
CASE_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in hp.items())}" for name, hp in CASES]

# ps.optim slot name -> the torch.optim state key holding the same tensor.
TORCH_STATE = {"sum": "sum", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _allocate(
    opt: Optimizer[Any], param: torch.Tensor, step_dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    state = {slot: opt.init_slot(slot, param) for slot in opt.slots}
    step = None if step_dtype is None else torch.zeros(param.shape[0], dtype=step_dtype)
    return state, step


@pytest.mark.parametrize(("name", "hp"), CASES, ids=CASE_IDS)
def test_dense_matches_torch_over_ten_steps(name: str, hp: dict[str, float]) -> None:
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(6, 5, generator=gen)
    opt = make_optimizer(name, hp)
    param = start.clone()
    state = {slot: opt.init_slot(slot, param) for slot in opt.slots}
    step = torch.zeros(1, dtype=torch.int64)
    ref = start.clone().requires_grad_(True)
    ref_opt = REFERENCE[name](ref, hp)

    for _ in range(STEPS):
        grad = torch.randn(6, 5, generator=gen)
        ref.grad = grad.clone()
        ref_opt.step()
        opt.apply_dense(param, grad, state, step)
        torch.testing.assert_close(param, ref.detach(), atol=ATOL, rtol=0)

    assert step.tolist() == [STEPS]
    for slot, tensor in state.items():
        torch.testing.assert_close(tensor, ref_opt.state[ref][TORCH_STATE[slot]], atol=ATOL, rtol=0)


@pytest.mark.parametrize("native", [False, True], ids=["torch-ops", "c-loops"])
@pytest.mark.parametrize("block_elements", [None, 24], ids=["one-block", "3-row-blocks"])
@pytest.mark.parametrize(("name", "hp"), CASES, ids=CASE_IDS)
def test_rows_match_torch_stepped_per_row(
    name: str, hp: dict[str, float], block_elements: int | None, native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if block_elements is not None:
        # Small blocks make one push span several, with a ragged last one.
        monkeypatch.setattr(ps.optim, "_ROWS_BLOCK_ELEMENTS", block_elements)
    # A table this small takes torch's row ops unless ps.rows is told to use its C loops.
    monkeypatch.setattr(ps.rows, "_MIN_ROWS", 0 if native else 10**9)
    monkeypatch.setattr(ps.rows, "_MIN_GATHER_ROWS", 0 if native else 10**9)
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(CAPACITY, DIM, generator=gen)
    opt = make_optimizer(name, hp)
    param = start.clone()
    state, step = _allocate(opt, param, torch.int64 if opt.uses_step else None)
    # Row r of the table follows its own torch parameter, stepped only when r is pushed.
    refs = [start[r].clone().requires_grad_(True) for r in range(CAPACITY)]
    ref_opts = [REFERENCE[name](p, hp) for p in refs]
    touches = [0] * CAPACITY

    for _ in range(STEPS):
        count = int(torch.randint(1, CAPACITY // 2, (1,), generator=gen))
        rows = torch.randperm(CAPACITY, generator=gen)[:count]
        grad = torch.randn(count, DIM, generator=gen)
        grad_before = grad.clone()
        untouched = torch.ones(CAPACITY, dtype=torch.bool)
        untouched[rows] = False
        before = {"param": param.clone(), **{s: t.clone() for s, t in state.items()}}

        opt.apply_rows(param, rows, grad, state, step)

        for i, r in enumerate(rows.tolist()):
            refs[r].grad = grad[i].clone()
            ref_opts[r].step()
            touches[r] += 1
        torch.testing.assert_close(
            param, torch.stack([p.detach() for p in refs]), atol=ATOL, rtol=0
        )
        after = {"param": param, **state}
        for what, tensor in after.items():
            assert torch.equal(tensor[untouched], before[what][untouched]), what
        assert torch.equal(grad, grad_before), "apply_rows must not modify the caller's grad"

    for slot, tensor in state.items():
        for r in range(CAPACITY):
            expected = (
                ref_opts[r].state[refs[r]][TORCH_STATE[slot]]
                if touches[r]
                else opt.init_slot(slot, tensor[r])
            )
            torch.testing.assert_close(tensor[r], expected, atol=ATOL, rtol=0)
    if step is not None:
        assert step.tolist() == touches


@pytest.mark.parametrize("step_dtype", [torch.int32, torch.int64])
def test_adam_rows_accept_int32_and_int64_steps(step_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    opt = Adam(AdamConfig(lr=0.05))
    param = torch.randn(4, 3, generator=gen)
    ref = param[1].clone().requires_grad_(True)
    ref_opt = _torch_adam(ref, {"lr": 0.05})
    state, step = _allocate(opt, param, step_dtype)
    # Row 1 has history the table restored (say from a checkpoint): 7 earlier updates.
    assert step is not None
    for _ in range(7):
        g = torch.randn(3, generator=gen)
        ref.grad = g.clone()
        ref_opt.step()
    state["exp_avg"][1] = ref_opt.state[ref]["exp_avg"]
    state["exp_avg_sq"][1] = ref_opt.state[ref]["exp_avg_sq"]
    param[1] = ref.detach()
    step[1] = 7

    g = torch.randn(1, 3, generator=gen)
    opt.apply_rows(param, torch.tensor([1]), g, state, step)
    ref.grad = g[0].clone()
    ref_opt.step()

    torch.testing.assert_close(param[1], ref.detach(), atol=ATOL, rtol=0)
    assert step.dtype == step_dtype
    assert step.tolist() == [0, 8, 0, 0]


def test_rows_count_steps_for_optimizers_without_bias_correction() -> None:
    opt = SGD(SGDConfig(lr=0.1))
    param = torch.zeros(5, 2)
    step = torch.zeros(5, dtype=torch.int64)
    opt.apply_rows(param, torch.tensor([0, 3]), torch.ones(2, 2), {}, step)
    opt.apply_rows(param, torch.tensor([3]), torch.ones(1, 2), {}, step)
    assert step.tolist() == [1, 0, 0, 2, 0]
    opt.apply_rows(param, torch.tensor([4]), torch.ones(1, 2), {}, None)
    assert step.tolist() == [1, 0, 0, 2, 0]


def test_empty_push_changes_nothing() -> None:
    opt = Adam()
    param = torch.randn(5, 2)
    state, step = _allocate(opt, param, torch.int64)
    before = param.clone()
    opt.apply_rows(param, torch.empty(0, dtype=torch.int64), torch.empty(0, 2), state, step)
    assert torch.equal(param, before)
    assert step is not None and step.sum().item() == 0


@pytest.mark.parametrize(
    ("opt", "slot", "value"),
    [
        (Adagrad(AdagradConfig(initial_accumulator_value=0.25)), "sum", 0.25),
        (Adam(), "exp_avg", 0.0),
        (Adam(), "exp_avg_sq", 0.0),
    ],
)
def test_init_slot_fills_new_contiguous_state(opt: Optimizer[Any], slot: str, value: float) -> None:
    like = torch.randn(8, 3).t()  # not contiguous
    fresh = opt.init_slot(slot, like)
    assert fresh.shape == like.shape and fresh.dtype == like.dtype
    assert fresh.is_contiguous()
    assert torch.equal(fresh, torch.full_like(like, value))


@pytest.mark.parametrize(
    ("name", "slots", "uses_step"),
    [("sgd", (), False), ("adagrad", ("sum",), False), ("adam", ("exp_avg", "exp_avg_sq"), True)],
)
def test_registry_describes_each_optimizer(
    name: str, slots: tuple[str, ...], uses_step: bool
) -> None:
    cls = OPTIMIZERS[name]
    assert cls.name == name and cls.slots == slots and cls.uses_step == uses_step
    opt = make_optimizer(name, {})
    assert type(opt) is cls
    assert opt.config == cls.config_type()


def test_make_optimizer_passes_hyperparameters() -> None:
    opt = make_optimizer("adam", {"lr": 0.5, "beta2": 0.9, "weight_decay": 1e-4})
    assert isinstance(opt, Adam)
    assert opt.config == AdamConfig(lr=0.5, beta2=0.9, weight_decay=1e-4)


@pytest.mark.parametrize(
    ("name", "params", "fragments"),
    [
        ("adamw", {}, ["'adamw'", "['adagrad', 'adam', 'ftrl', 'rowwise_adagrad', 'sgd']"]),
        ("sgd", {"momentum": 0.9}, ["'momentum'", "['lr', 'weight_decay']"]),
        ("adam", {"betas": 0.9, "lr": 0.1}, ["'betas'", "beta1"]),
        ("adagrad", {"lr": -1.0}, ["AdagradConfig.lr", "-1.0"]),
    ],
)
def test_make_optimizer_rejects_unknown_names_and_values(
    name: str, params: dict[str, float], fragments: list[str]
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        make_optimizer(name, params)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("config_type", "kwargs", "fragment"),
    [
        (SGDConfig, {"lr": 0.0}, "SGDConfig.lr must be > 0, got 0.0"),
        (SGDConfig, {"lr": float("nan")}, "SGDConfig.lr must be finite, got nan"),
        (SGDConfig, {"lr": float("inf")}, "SGDConfig.lr must be finite"),
        (SGDConfig, {"lr": True}, "SGDConfig.lr must be a real number, got True"),
        (SGDConfig, {"lr": "0.1"}, "got '0.1' of type str"),
        (SGDConfig, {"weight_decay": -0.1}, "SGDConfig.weight_decay must be >= 0, got -0.1"),
        (AdagradConfig, {"lr": -0.5}, "AdagradConfig.lr must be > 0, got -0.5"),
        (AdagradConfig, {"eps": 0.0}, "AdagradConfig.eps must be > 0, got 0.0"),
        (AdagradConfig, {"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
        (AdagradConfig, {"weight_decay": -1e-3}, "AdagradConfig.weight_decay must be >= 0"),
        (AdamConfig, {"beta1": 1.0}, "AdamConfig.beta1 must lie in [0, 1), got 1.0"),
        (AdamConfig, {"beta1": -0.1}, "AdamConfig.beta1 must lie in [0, 1), got -0.1"),
        (AdamConfig, {"beta2": 1.5}, "AdamConfig.beta2 must lie in [0, 1), got 1.5"),
        (AdamConfig, {"eps": -1e-8}, "AdamConfig.eps must be > 0, got -1e-08"),
        (AdamConfig, {"lr": float("-inf")}, "AdamConfig.lr must be finite"),
        (AdamConfig, {"weight_decay": -1.0}, "AdamConfig.weight_decay must be >= 0"),
    ],
)
def test_config_validation(config_type: type[Any], kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        config_type(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "config", [SGDConfig(), AdagradConfig(), AdamConfig(beta1=0.0, weight_decay=0.0)]
)
def test_configs_are_frozen(config: Any) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0


def test_optimizer_refuses_another_optimizers_config() -> None:
    with pytest.raises(InvalidArgumentError, match="Adam takes a AdamConfig"):
        Adam(SGDConfig())  # type: ignore[arg-type]


def _rows_call(**overrides: Any) -> dict[str, Any]:
    param = torch.zeros(CAPACITY, DIM)
    call: dict[str, Any] = {
        "param": param,
        "rows": torch.tensor([1, 4]),
        "grad": torch.ones(2, DIM),
        "state": {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)},
        "step": torch.zeros(CAPACITY, dtype=torch.int64),
    }
    call.update(overrides)
    return call


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"rows": torch.tensor([1, 4], dtype=torch.int32)}, "rows must be a 1-D int64"),
        ({"rows": torch.tensor([[1, 4]])}, "rows must be a 1-D int64"),
        ({"rows": torch.tensor([1, CAPACITY])}, f"rows must lie in [0, {CAPACITY}), got values"),
        ({"rows": torch.tensor([-1, 4])}, "got values from -1 to 4"),
        ({"grad": torch.ones(3, DIM)}, "grad must have shape [len(rows), dim] = [2, 8]"),
        ({"grad": torch.ones(2, DIM, dtype=torch.float64)}, "grad has dtype torch.float64"),
        ({"state": {"exp_avg": torch.zeros(CAPACITY, DIM)}}, "needs state slot 'exp_avg_sq'"),
        (
            {"state": {"exp_avg": torch.zeros(CAPACITY, DIM), "exp_avg_sq": torch.zeros(3, 3)}},
            "state['exp_avg_sq'] has shape [3, 3]",
        ),
        ({"step": None}, "keeps a per-row update count"),
        ({"step": torch.zeros(CAPACITY, dtype=torch.float32)}, "step must be an int32 or int64"),
        ({"step": torch.zeros(CAPACITY + 1, dtype=torch.int64)}, "shape [capacity] = [50]"),
        ({"param": torch.zeros(CAPACITY * DIM)}, "param must be a [capacity, dim] table"),
        ({"param": torch.zeros(CAPACITY, DIM, dtype=torch.int64)}, "floating-point"),
    ],
)
def test_apply_rows_rejects_bad_input_before_writing(
    overrides: dict[str, Any], fragment: str
) -> None:
    call = _rows_call(**overrides)
    snapshot = {
        k: (v.clone() if isinstance(v, torch.Tensor) else {s: t.clone() for s, t in v.items()})
        for k, v in call.items()
        if v is not None
    }
    with pytest.raises(InvalidArgumentError) as info:
        Adam().apply_rows(**call)
    assert fragment in str(info.value)
    for key, before in snapshot.items():
        if isinstance(before, torch.Tensor):
            assert torch.equal(call[key], before), key
        else:
            for slot, tensor in before.items():
                assert torch.equal(call[key][slot], tensor), slot


@pytest.mark.parametrize(
    ("grad", "step", "fragment"),
    [
        (torch.ones(3, 2), torch.zeros(1, dtype=torch.int64), "grad has shape [3, 2]"),
        (torch.ones(2, 3), torch.zeros(2, dtype=torch.int64), "step must be an integer tensor"),
        (torch.ones(2, 3), torch.zeros(1), "step must be an integer tensor"),
    ],
)
def test_apply_dense_rejects_bad_input(
    grad: torch.Tensor, step: torch.Tensor, fragment: str
) -> None:
    param = torch.zeros(2, 3)
    with pytest.raises(InvalidArgumentError) as info:
        SGD().apply_dense(param, grad, {}, step)
    assert fragment in str(info.value)
    assert torch.equal(param, torch.zeros(2, 3))


def test_init_slot_rejects_unknown_slot() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no state slot 'sum'; its slots are \[\]"):
        SGD().init_slot("sum", torch.zeros(2))


# ---- row-wise Adagrad and FTRL against plain implementations of their formulas ------------


@pytest.mark.parametrize(("name", "hp"), NEW_CASES, ids=str)
def test_new_rules_on_a_dense_block_match_their_references(name: str, hp: dict[str, float]
                                                          ) -> None:
    opt = make_optimizer(name, hp)
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(6, 5, generator=gen)
    start = param.clone()
    state = {s: opt.init_slot(s, param) for s in opt.slots}
    step = torch.zeros(1, dtype=torch.int64)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(10)]
    for g in grads:
        opt.apply_dense(param, g, state, step)
    torch.testing.assert_close(param.double(), reference(name, start, grads, hp), atol=1e-6,
                               rtol=0)
    if name == "ftrl" and hp.get("l1", 0.0) >= 1.0:
        assert (param == 0).any()  # a strong L1 makes weights exactly zero


@pytest.mark.parametrize(("name", "hp"), NEW_CASES, ids=str)
def test_new_rules_on_sparse_rows_match_their_references(name: str, hp: dict[str, float]
                                                        ) -> None:
    """Rows touched in different steps: each row follows its own gradient history."""
    opt = make_optimizer(name, hp)
    gen = torch.Generator().manual_seed(4)
    capacity, dim = 12, 4
    param = torch.randn(capacity, dim, generator=gen)
    start = param.clone()
    state = {s: opt.init_slot(s, param) for s in opt.slots}
    history: dict[int, list[torch.Tensor]] = {r: [] for r in range(capacity)}
    for _ in range(8):
        rows = torch.randperm(capacity, generator=gen)[:5]
        grad = torch.randn(5, dim, generator=gen)
        opt.apply_rows(param, rows, grad, state, None)
        for r, g in zip(rows.tolist(), grad, strict=True):
            history[r].append(g.view(1, dim))
    for r in range(capacity):
        expected = reference(name, start[r : r + 1], history[r], hp)
        torch.testing.assert_close(param[r : r + 1].double(), expected, atol=1e-6, rtol=0)


def test_rowwise_adagrad_keeps_one_accumulator_per_row() -> None:
    opt = make_optimizer("rowwise_adagrad", {"initial_accumulator_value": 0.5})
    assert opt.init_slot("sum", torch.zeros(7, 16)).shape == (7, 1)
    assert opt.slot_width(16) == 1 and make_optimizer("adagrad", {}).slot_width(16) == 16
    assert opt.init_slot("sum", torch.zeros(())).shape == ()
    with pytest.raises(InvalidArgumentError, match=r"keeps \[7, 1\] for a parameter of shape"):
        opt.apply_rows(torch.zeros(7, 16), torch.tensor([1]), torch.ones(1, 16),
                       {"sum": torch.zeros(7, 16)}, None)


def test_ftrl_refuses_a_configuration_that_divides_by_zero() -> None:
    with pytest.raises(InvalidArgumentError, match="needs beta > 0, l2 > 0 or"):
        make_optimizer("ftrl", {"beta": 0.0})
    make_optimizer("ftrl", {"beta": 0.0, "l2": 0.1})


# ---- compact rows: float16 and bfloat16 storage, float32 arithmetic ---------------------------

ALL_RULES = [("sgd", {"lr": 0.1}), ("adagrad", {"lr": 0.1}), ("adam", {"lr": 0.01}),
             ("rowwise_adagrad", {"lr": 0.1}), ("ftrl", {"lr": 0.1, "l1": 0.01})]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "hp"), ALL_RULES, ids=str)
def test_compact_rows_update_in_float32_and_round_once(name: str, hp: dict[str, float],
                                                       dtype: torch.dtype) -> None:
    """Each update widens the stored rows, runs the float32 rule with float32 state and rounds
    the result back once: bit for bit what the float32 rule gives on the rounded rows."""
    opt = make_optimizer(name, hp)
    gen = torch.Generator().manual_seed(6)
    capacity, dim = 10, 6
    param = torch.randn(capacity, dim, generator=gen).to(dtype)
    state = {s: opt.init_slot(s, param) for s in opt.slots}
    assert all(v.dtype == torch.float32 for v in state.values())
    step = torch.zeros(capacity, dtype=torch.int64)
    ref_param = param.float()
    ref_state = {s: opt.init_slot(s, ref_param) for s in opt.slots}
    ref_step = step.clone()
    for _ in range(6):
        rows = torch.randperm(capacity, generator=gen)[:4]
        grad = torch.randn(4, dim, generator=gen).to(dtype)
        opt.apply_rows(param, rows, grad, state, step)
        opt.apply_rows(ref_param, rows, grad.float(), ref_state, ref_step)
        ref_param.copy_(ref_param.to(dtype).float())  # the storage rounds once per update
    assert param.dtype == dtype
    assert torch.equal(param.float(), ref_param)
    for k in opt.slots:
        assert torch.equal(state[k], ref_state[k])

    block = torch.randn(5, dim, generator=gen).to(dtype)
    ref_block = block.float()
    dense_state = {s: opt.init_slot(s, block) for s in opt.slots}
    ref_dense_state = {s: opt.init_slot(s, ref_block) for s in opt.slots}
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    for _ in range(4):
        grad = torch.randn(5, dim, generator=gen).to(dtype)
        opt.apply_dense(block, grad, dense_state, counts[0])
        opt.apply_dense(ref_block, grad.float(), ref_dense_state, counts[1])
        ref_block.copy_(ref_block.to(dtype).float())
    assert torch.equal(block.float(), ref_block)


def test_compact_state_of_the_rows_dtype_is_refused() -> None:
    opt = make_optimizer("adagrad", {})
    param = torch.zeros(4, 3, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match=r"keeps its state in torch\.float32"):
        opt.apply_rows(param, torch.tensor([0]), torch.ones(1, 3, dtype=torch.float16),
                       {"sum": torch.zeros(4, 3, dtype=torch.float16)}, None)
