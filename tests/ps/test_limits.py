"""What a server may be asked to hold: sizes as flags give them, sizes for people, and the
limits' own checks. Tables of cases, no threads and no processes."""

from __future__ import annotations

import re

import pytest

from ps.errors import InvalidArgumentError
from ps.limits import Limits, format_size, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("0", 0),
        ("4096", 4096),
        ("18446744073709551617", 2**64 + 1),  # whole numbers stay exact
        ("512MiB", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("64k", 64 * KiB),
        ("64K", 64 * KiB),
        ("2M", 2 * MiB),
        ("3Mi", 3 * MiB),
        ("10KB", 10_000),
        ("1TB", 10**12),
        ("1TiB", 1 << 40),
        ("100B", 100),
        (" 8 GiB ", 8 * GiB),
        (".5MiB", MiB // 2),
        ("1e3", 1000),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "text", ["", "GiB", "-1", "-1GiB", "8 GiBs", "8XB", "1,5GB", "nan", "inf", "0x10", "1.2.3"],
)
def test_a_bad_size_is_refused_naming_it_and_the_flag(text: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_size(text, "--memory-budget")
    assert str(err.value).startswith(f"--memory-budget: {text!r} is not a size;")
    assert "512MiB, 8GiB or 1.5GB" in str(err.value)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (900, "900 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (64 * MiB, "64 MiB"),
        (64 * MiB + 1, "64 MiB"),
        (int(8.3 * GiB), "8.3 GiB"),
        (int(1.256 * GiB), "1.26 GiB"),
        (3 << 40, "3 TiB"),
        (5000 << 40, "5000 TiB"),
    ],
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_rows": 0}, "max_new_rows must be >= 1, got 0"),
        ({"memory_budget_bytes": -1}, "memory_budget_bytes must be >= 0 (0: no budget), got -1"),
    ],
)
def test_limits_refuse_values_no_server_could_run_with(fields: dict[str, int],
                                                       message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        Limits(**fields)


def test_the_default_limits_are_no_budget_and_a_large_row_count() -> None:
    limits = Limits()
    assert (limits.memory_budget_bytes, limits.max_new_rows) == (0, 1 << 24)
