"""The analysing processes keep freed buffers for the next trace (trace/allocator.py): glibc's
default gives a freed block over 128 KiB back to the OS and the next trace faults fresh pages in
(measured: ~260 minor faults, a tenth of a small trace's analysis, on these VMs). Counted here in
fresh interpreters (the settings are process-wide): page faults, not times. (glibc's own
heuristics decide when a simple pattern of blocks faults; a real analysis shows it.)"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "public" / "sglang_qwen3_8b_decode_bs32_mi300x.json.gz"
glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's mallopt only")

FAULTS_OF_SECOND_ANALYSIS = """
import contextlib, io, resource, sys
from servprof.cli import main
def analyse():
    with contextlib.redirect_stdout(io.TextIOWrapper(io.BytesIO())):
        assert main(["analyze", sys.argv[1], "--json", "-"]) == 0
analyse(); analyse()  # (the first analyses fault in what the process will reuse)
counts = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    analyse()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(counts)[2])
"""


def _count(script: str, argument: str) -> int:
    done = subprocess.run([sys.executable, "-c", script, argument], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@glibc
def test_the_allocator_takes_the_settings() -> None:
    done = subprocess.run([sys.executable, "-c", "from servprof.trace.allocator import keep_freed_memory_for_reuse as k; "
                           "print(k())"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


@glibc
def test_analyze_keeps_its_buffers_from_trace_to_trace() -> None:
    """`servprof analyze` asks for it: once warm, an analysis of a small trace faults in next to
    no pages (the median of five; without it: ~250 each)."""
    assert _count(FAULTS_OF_SECOND_ANALYSIS, str(FIXTURE)) < 64
