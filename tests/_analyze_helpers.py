"""Paths shared by the trace / detector / analyze tests."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
# CI checks out ../shared beside the clone; a laptop clone may not have it.
SHARED_TRACES = Path(__file__).parents[2] / "shared" / "traces"


def shared_trace(name: str) -> Path:
    path = SHARED_TRACES / name
    if not path.exists():
        pytest.skip(f"public trace {name} not found under {SHARED_TRACES} (shared/ is not beside this clone)")
    return path


def fixture(name: str) -> Path:
    return FIXTURES / f"demo_{name}.json.gz"
