"""Which tests the long tier holds: the patterns of tests/conftest.py's LONG, as a table."""

from __future__ import annotations

import pytest
from conftest import matches


@pytest.mark.parametrize(
    ("nodeid", "pattern", "expected"),
    [
        ("tests/deploy/test_kubernetes.py::test_x", "tests/deploy/", True),
        ("tests/deployment.py::test_x", "tests/deploy/", False),
        ("tests/a.py::test_x", "tests/a.py", True),
        ("tests/a.py::test_x[grpc]", "tests/a.py::test_x", True),
        ("tests/a.py::test_xy", "tests/a.py::test_x", False),
        ("tests/ab.py::test_x", "tests/a.py", False),
        ("tests/a.py::test_x[ucx-tcp]", "tests/a.py::*[ucx-*", True),
        ("tests/a.py::test_x[shm]", "tests/a.py::*[ucx-*", False),
        ("tests/a.py::test_x[truncated]", "tests/a.py::test_x*[truncated]", True),
        ("tests/a.py::test_x[flipped]", "tests/a.py::test_x*[truncated]", False),
        ("tests/a.py::test_under_a_hog", "tests/a.py::test_under_*", True),
        ("tests/b.py::test_under_a_hog", "tests/a.py::test_under_*", False),
    ],
)
def test_a_pattern_is_a_test_a_file_a_folder_or_a_fit_with_stars(
        nodeid: str, pattern: str, expected: bool) -> None:
    assert matches(nodeid, pattern) is expected
