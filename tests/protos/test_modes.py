"""The one parser of consistency modes, and its codec to the wire, table-driven."""

from __future__ import annotations

import pytest

from protos import modes
from protos import pstrain_pb2 as pb
from protos.modes import Kind, Mode, ModeError


@pytest.mark.parametrize(
    ("text", "kind", "staleness"),
    [
        ("sync", Kind.SYNC, None),
        ("async", Kind.ASYNC, None),
        ("ssp", Kind.SSP, None),  # the default bound, filled in by whoever applies it
        ("ssp:0", Kind.SSP, 0),
        ("ssp:3", Kind.SSP, 3),
        ("ssp:120", Kind.SSP, 120),
    ],
)
def test_parse(text: str, kind: Kind, staleness: int | None) -> None:
    mode = modes.parse(text)
    assert (mode.kind, mode.staleness) == (kind, staleness)
    assert str(mode) == text  # the grammar back
    assert modes.parse(str(mode)) == mode


@pytest.mark.parametrize(
    "text",
    ["", "bsp", "SYNC", "Sync", " sync", "sync ", "sync:", "sync:1", "async:0", "ssp:",
     "ssp:-1", "ssp:x", "ssp:1.5", "ssp: 2", "ssp:2:3", "ssp:²", "ssp:+2", "ssp=2", ":3"],
)
def test_parse_rejects_naming_the_value_and_the_choices(text: str) -> None:
    with pytest.raises(ModeError) as err:
        modes.parse(text)
    message = str(err.value)
    assert f"unknown consistency mode {text!r}" in message
    assert modes.CHOICES in message


def test_parse_rejects_a_non_string() -> None:
    with pytest.raises(ModeError, match="a consistency mode is a string, got 3"):
        modes.parse(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [("", None), ("sync", modes.SYNC),
                                                ("ssp:2", Mode(Kind.SSP, 2))])
def test_parse_optional(text: str, expected: Mode | None) -> None:
    assert modes.parse_optional(text) == expected


@pytest.mark.parametrize(
    ("kind", "staleness", "match"),
    [
        (Kind.SYNC, 1, "only ssp takes a staleness bound, got sync with 1"),
        (Kind.ASYNC, 0, "only ssp takes a staleness bound, got async with 0"),
        (Kind.SSP, -1, "must be an int >= 0, got -1"),
        (Kind.SSP, True, "must be an int >= 0, got True"),
        (Kind.SSP, 2.0, "must be an int >= 0, got 2.0"),
        ("ssp", 2, "mode kind must be a Kind, got 'ssp'"),
    ],
)
def test_mode_checks_itself(kind: Kind, staleness: object, match: str) -> None:
    with pytest.raises(ModeError, match=match):
        Mode(kind, staleness)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "default", "expected"),
    [
        (modes.SSP, 4, Mode(Kind.SSP, 4)),  # the bound left to the default
        (Mode(Kind.SSP, 1), 4, Mode(Kind.SSP, 1)),  # its own bound wins
        (modes.SYNC, 4, modes.SYNC),  # other kinds have no bound
        (modes.ASYNC, 4, modes.ASYNC),
    ],
)
def test_with_default(mode: Mode, default: int, expected: Mode) -> None:
    assert mode.with_default(default) == expected


@pytest.mark.parametrize(
    ("mode", "wire", "staleness"),
    [
        (None, pb.MODE_UNSPECIFIED, None),
        (modes.SYNC, pb.SYNC, None),
        (modes.ASYNC, pb.ASYNC, None),
        (modes.SSP, pb.SSP, None),
        (Mode(Kind.SSP, 0), pb.SSP, 0),
        (Mode(Kind.SSP, 7), pb.SSP, 7),
    ],
)
def test_proto_round_trip(mode: Mode | None, wire: pb.Mode, staleness: int | None) -> None:
    assert modes.to_proto(mode) == (wire, staleness)
    assert modes.from_proto(wire, staleness) == mode
    # Through a real message: "ssp" and "ssp:0" stay apart on the wire.
    sent = pb.TableSpec(name="t", consistency=wire, staleness=staleness).SerializeToString()
    got = pb.TableSpec.FromString(sent)
    assert got.HasField("staleness") is (staleness is not None)
    assert modes.from_proto(
        got.consistency, got.staleness if got.HasField("staleness") else None
    ) == mode


@pytest.mark.parametrize(
    ("wire", "staleness", "match"),
    [
        (pb.MODE_UNSPECIFIED, 2, r"a staleness bound \(2\) needs the mode SSP"),
        (pb.SYNC, 2, "only ssp takes a staleness bound, got sync with 2"),
        (pb.ASYNC, 0, "only ssp takes a staleness bound, got async with 0"),
        (pb.SSP, -1, "must be an int >= 0, got -1"),
        (9, None, "unknown consistency mode 9 on the wire"),
    ],
)
def test_from_proto_rejects(wire: int, staleness: int | None, match: str) -> None:
    with pytest.raises(ModeError, match=match):
        modes.from_proto(wire, staleness)


def test_every_kind_has_a_wire_value_and_back() -> None:
    assert modes.KINDS == ("sync", "ssp", "async")
    for kind in Kind:
        wire, _ = modes.to_proto(Mode(kind))
        assert wire != pb.MODE_UNSPECIFIED
        assert pb.Mode.Name(wire).lower() == kind.value
        assert modes.from_proto(wire) == Mode(kind)
