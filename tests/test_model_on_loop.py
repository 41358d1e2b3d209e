"""The model run on the event loop's thread is named as the cause: a server that streams from an
async generator running one forward per token (tests/servers/loop_bound.py) and one that calls
``model.generate()`` inside an ``async def`` handler. The servers that run their model in threads
(tests/test_zero_touch.py) get no such finding there.

Real parts: uvicorn on loopback, the real profiler and analysis child, a real tiny transformers
Llama and a real BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _server_session import session_on

from servprof.detect.model_on_loop import CAUSE

MAX_TOKENS = 8
STREAMS = 2  # streaming requests in the session, beside one blocking generate()


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return session_on("servers.loop_bound", tmp_path_factory.mktemp("loop_bound"),
                      ["/v1/completions"] * STREAMS + ["/v1/generate"], MAX_TOKENS)


def test_the_model_on_the_loop_is_named_with_its_steps(observed: dict[str, Any]) -> None:
    result, session = observed["result"], observed["session"]
    assert sorted(status for _, status, _ in observed["responses"]) == [200] * (STREAMS + 1)
    assert result["error"] is None, result["error"]
    (finding,) = [f for f in result["findings"] if f["evidence"].get("cause") == CAUSE]
    evidence = finding["evidence"]
    assert finding["kind"] == "loop_stall" and finding["fix"] and "asyncio.to_thread" in finding["fix"]
    assert evidence["loop_tid"] == session["watchdog"]["loop_tid"]
    assert "LlamaForCausalLM" in finding["title"] and evidence["models"] == ["LlamaForCausalLM"]
    # Every step of the session ran on the loop: one prefill and one forward per further token for
    # each request, the streams' and generate()'s alike.
    detect = result["summary"]["detect"]
    assert evidence["steps"] == detect["steps"]["count"] == (STREAMS + 1) * MAX_TOKENS
    assert evidence["step_kinds"] == {"decode": (STREAMS + 1) * (MAX_TOKENS - 1), "prefill": STREAMS + 1}
    # Its cost is those steps' time, as the requests' own step phases measure it.
    phases = [p for rid in result["requests"] for p in result["requests"][rid]["phases"]
              if p["name"] in ("prefill", "decode_step")]
    assert len(phases) == evidence["steps"]
    assert finding["cost_ms"] == pytest.approx(sum(p["end_us"] - p["start_us"] for p in phases) / 1e3, rel=1e-3)
    assert 0 < evidence["share_of_loop_time"] <= 1
    assert sorted(finding["request_ids"]) == sorted(rid for _, _, rid in observed["responses"])
    assert detect["loop_stalls"]["model_on_loop"]["steps_on_loop"] == evidence["steps"]


def test_an_offline_trace_says_nothing_about_an_event_loop(tmp_path: Path) -> None:
    from servprof.cli import main

    out = tmp_path / "report.json"
    fixture = Path(__file__).parent / "fixtures" / "public" / "hf_qwen1.5_0.5b_prefill_h100.json.gz"
    assert main(["analyze", str(fixture), "--json", str(out)]) == 0
    import orjson

    report = orjson.loads(out.read_bytes())
    assert report["summary"]["loop_stalls"]["model_on_loop"] == {"loop_tid": None, "steps_on_loop": 0}
    assert not [f for f in report["findings"] if f["evidence"].get("cause") == CAUSE]
