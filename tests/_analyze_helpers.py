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


def record_phase_trace(folder: Path, name: str = "s1") -> Path:
    """A real profiler capture with servprof phases (r1 tokenizes, then r1 and r2 share a decode
    step), gzipped as the store writes it: ``folder/<name>.pt.trace.json.gz``."""
    import gzip

    import torch
    from _middleware_helpers import wait_idle, wait_warm
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from servprof.phases import phase

    wait_warm()
    wait_idle()  # never start a second profiler while servprof's own one (or its warm-up) runs
    prof = profile(activities=[ProfilerActivity.CPU],
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.start()
    with phase("tokenize", request_id="r1"):
        torch.ones(8).sum()
    with phase("decode_step", request_ids=["r1", "r2"]):
        torch.ones(8) * 2
    prof.stop()
    raw = folder / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    path = folder / f"{name}.pt.trace.json.gz"
    path.write_bytes(gzip.compress(raw.read_bytes()))
    return path
