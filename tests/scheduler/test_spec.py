"""The job spec's consistency mode: validated by the one parser, its bound kept apart."""

from __future__ import annotations

import pytest

from protos import modes
from protos.modes import Kind, Mode
from scheduler.errors import SpecError
from scheduler.spec import JobSpec


@pytest.mark.parametrize(
    ("mode", "staleness", "consistency"),
    [
        ("async", 0, modes.ASYNC),
        ("sync", 5, modes.SYNC),  # the bound only matters to ssp tables
        ("ssp", 0, Mode(Kind.SSP, 0)),
        ("ssp", 4, Mode(Kind.SSP, 4)),
    ],
)
def test_consistency(mode: str, staleness: int, consistency: Mode) -> None:
    spec = JobSpec("j", mode=mode, staleness=staleness)
    assert spec.consistency == consistency
    assert JobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("bsp", f"job 'j': unknown consistency mode 'bsp'; choose {modes.CHOICES}"),
        ("", "job 'j': unknown consistency mode ''"),
        ("ssp:3", "mode 'ssp:3': a job keeps the ssp bound apart; give mode 'ssp' and "
                  "staleness 3"),
    ],
)
def test_bad_modes_are_refused(mode: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec("j", mode=mode)
    assert message in str(err.value)


def test_a_stored_spec_with_a_bad_mode_is_refused() -> None:
    with pytest.raises(SpecError, match="unknown consistency mode 'bsp'"):
        JobSpec.from_json('{"job": "j", "mode": "bsp"}')


@pytest.mark.parametrize(("fields", "message"), [
    ({"checkpoint_full_every": 0}, "checkpoint_full_every must be >= 1 (1: all full), got 0"),
    ({"checkpoint_keep": -2}, "checkpoint_keep must be >= 0 (0: keep all), got -2"),
    ({"checkpoint_write_mb_s": -1.0},
     "checkpoint_write_mb_s must be >= 0 (0: no limit), got -1.0"),
    ({"checkpoint_write_mb_s": float("nan")},
     "checkpoint_write_mb_s must be >= 0 (0: no limit), got nan"),
])
def test_bad_checkpoint_retention_is_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec("j", **fields)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_a_spec_stored_before_deltas_reads_with_the_defaults() -> None:
    spec = JobSpec.from_json('{"job": "j", "mode": "sync"}')
    assert (spec.checkpoint_full_every, spec.checkpoint_keep) == (10, 3)
