"""bench/bench_middleware_overhead.py runs end to end on a few requests and reports every
case and set-up (its figures are for the closing note, not for this test)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import bench_middleware_overhead as bench  # noqa: E402  (its OTel ASGI dependency is in the test extra)


def test_every_case_and_set_up_is_reported(capsys: Any) -> None:
    assert bench.main(["--rounds", "1", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    for title in ("plain JSON response", "SSE stream, 64 chunks", "OpenAI chat stream"):
        assert title in out
    verdicts = [line for line in out.splitlines() if "-> ratio" in line]
    assert len(verdicts) == 6  # 3 cases x (servprof, servprof + telemetry span)
    assert sum("goal" in line and "no goal" not in line for line in verdicts) == 4


def test_the_openai_case_reaches_servprofs_genai_fields() -> None:
    """The OpenAI case is what servprof reads GenAI attributes from: its body parses as one."""
    from servprof.telemetry.attributes import genai_request_attributes

    case = bench.OPENAI
    fields = genai_request_attributes(case.method, case.path, case.body)
    assert fields["gen_ai.operation.name"] == "chat" and fields["gen_ai.request.stream"] is True
