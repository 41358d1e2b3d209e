"""Paths shared by the trace / detector / analyze tests."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
# Public GPU traces vendored with their licence and source (fixtures/public/NOTICE.md), so the
# suite needs nothing beside the clone.
PUBLIC_TRACES = FIXTURES / "public"


def public_trace(name: str) -> Path:
    path = PUBLIC_TRACES / name
    if not path.exists():  # a missing vendored file is a broken checkout, never a skip
        pytest.fail(f"public trace {name} is missing from {PUBLIC_TRACES}")
    return path


def fixture(name: str) -> Path:
    return FIXTURES / f"demo_{name}.json.gz"
