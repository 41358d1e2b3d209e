"""Python's garbage collector inside a decode loop (tests/servers/gc_heavy.py: a server that keeps
what it generates in Python objects). A collection of the oldest generation walks the whole heap
with the GIL held, for hundreds of milliseconds here; the profiler records nothing of it. servprof's
session marks each older collection on its thread (auto/gc_ranges.py) and the gaps they make are
named for what they are, with the fix (gc.freeze() after start-up), not blamed on the op or the
other thread that happened to be around; the event loop's stalls while it held the GIL too.

Real parts: uvicorn on loopback, a light and a deep session of the real profiler and analysis worker, the
servers' real transformers Llama, and the collector's own collections (their count depends on the
heap, so the test asks for at least one, and for the gaps it made).
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
from _server_session import session_on

REQUESTS = 3


@pytest.mark.parametrize("tier", ["light", "deep"])
def test_collections_are_marked_and_named_as_the_gaps_cause(tmp_path: Path, tier: str) -> None:
    # (A full collection first: what earlier tests left pending would otherwise decide whether one
    # falls inside the session; from here, the history the requests add passes the collector's
    # threshold for the oldest generation.)
    gc.collect()
    try:
        observed = session_on("servers.gc_heavy", tmp_path, ["/v1/completions"] * REQUESTS, 24, tier=tier)
    finally:  # (the history the server kept would slow every later collection of this test process)
        import servers.gc_heavy

        servers.gc_heavy.HISTORY.clear()
        gc.collect()
    session, result = observed["session"], observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200] * REQUESTS
    assert result["error"] is None, result["error"]
    assert session["gc_collections"] >= 1
    gaps = [f for f in result["findings"] if f["kind"] == "decode_gap" and f["evidence"].get("cause") == "python_gc"]
    assert gaps and gaps[0]["severity"] != "info", [(f["severity"], f["title"][:120]) for f in result["findings"]]
    assert "garbage collector" in gaps[0]["title"] and "gc.freeze()" in gaps[0]["fix"]
    # Each such gap shows the collection: the time collecting on the threads it names (the model's
    # own, the one it waited for, or both: on a loaded machine two collections can fall in one gap).
    worst = gaps[0]["evidence"]["worst_gaps"][0]
    own = worst["self_us"].get("gc", 0.0)
    elsewhere = worst.get("ran_instead", {}).get("self_us", {}).get("gc", 0.0)
    assert worst["collected_us"] == pytest.approx(own + elsewhere, abs=0.2)
    assert worst["collected_us"] >= 0.5 * worst["idle_us"]
    said_ms = float(re.search(r"([0-9.]+) ms collecting", worst["explanation"]).group(1))
    assert said_ms == pytest.approx(worst["collected_us"] / 1000, rel=0.1)  # (a thread's sliver unnamed)
    # The serving loop, kept from running while the collector held the GIL: the stall is named for it.
    stalls = [f for f in result["findings"] if f["kind"] == "loop_stall"]
    assert any(f["evidence"]["function"] == "Python's garbage collector" and "gc.freeze()" in f["fix"] for f in stalls), \
        [f["title"][:120] for f in stalls]
    # The session's hook is gone with it.
    assert not [c for c in gc.callbacks if "GcRanges" in repr(c)]
