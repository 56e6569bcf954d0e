"""Fixtures for the deployment tests: parsing `pstrain ...` command lines with the real parsers
(tests/deployment.py)."""

from __future__ import annotations

import pytest
from deployment import ParseCommand, parse_pstrain


@pytest.fixture
def parse_command() -> ParseCommand:
    return parse_pstrain
