"""The middleware's analysis child (`python -m servprof.analysis`) runs these detectors on a
session trace and hands back the contract's result (docs/CONTRACTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
from _analyze_helpers import fixture


def test_analysis_child_returns_findings_for_a_session(tmp_path: Path):
    trace = fixture("step_delay_20ms")
    session = tmp_path / "session.json"
    result_path = tmp_path / "result.json"
    session.write_bytes(orjson.dumps({"session_id": "fixture-step_delay_20ms",
                                      "requests": [{"request_id": "req-step_delay_20ms-0"}]}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "servprof.analysis", str(trace), str(session), str(result_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = orjson.loads(result_path.read_bytes())
    assert result["error"] is None and result["session_id"] == "fixture-step_delay_20ms"
    kinds = [f["kind"] for f in result["findings"]]
    assert "decode_gap" in kinds and "tokenization_stall" not in kinds
    gap = next(f for f in result["findings"] if f["kind"] == "decode_gap")
    assert gap["evidence"]["cause"] == "untraced_host_time"
    phases = result["requests"]["req-step_delay_20ms-0"]["phases"]
    assert [p["name"] for p in phases][:3] == ["tokenize", "queue", "prefill"]
