"""A server whose model runs in a worker process (tests/servers/process_pool.py): the serving
process servprof is in never runs a forward. servprof says that first, with what to do about it
(record the process that runs the model), instead of asking for step markers the serving process
has no step to put in, and names no step, gap or kernel.

Real parts: uvicorn on loopback, a light session of the real profiler and the real analysis
worker, a real ProcessPoolExecutor (spawn) running a real transformers Llama's ``generate``.
"""

from __future__ import annotations

from pathlib import Path

import orjson
from _server_session import session_on

from servprof.cli import main


def test_a_model_in_another_process_is_said_to_be_there_not_missing_markers(tmp_path: Path) -> None:
    observed = session_on("servers.process_pool", tmp_path, ["/v1/generate"] * 2, 4)
    result, session = observed["result"], observed["session"]
    assert [status for _, status, _ in observed["responses"]] == [200, 200]
    assert result["error"] is None, result["error"]
    assert session["auto"]["steps"] == 0 and session["auto"]["models"] == []
    assert result["summary"]["model_steps"] == 0
    missing = result["summary"]["missing"]
    assert missing[0]["what"] == "automatic model steps", missing
    assert "runs in another process (a process pool" in missing[0]["message"]
    assert "servprof analyze" in missing[0]["message"]
    # The generic "no step in this trace: mark your steps" would send the user to the wrong process.
    assert "model steps" not in [m["what"] for m in missing]
    assert not [f for f in result["findings"] if f["kind"] in ("decode_gap", "bandwidth_bound_decode", "queue_wait")]
    # `servprof analyze` on the session's trace afterwards says the same: the trace carries what the
    # serving side saw.
    report = tmp_path / "report.json"
    assert main(["analyze", str(tmp_path / "traces"), "--json", str(report)]) == 0
    again = orjson.loads(report.read_bytes())["summary"]["missing"]
    assert again[0] == missing[0] and "model steps" not in [m["what"] for m in again]


def test_only_the_no_forward_entry_stands_for_the_traces_no_step() -> None:
    """Another serving-side entry about automatic steps (a compiled model, hooks that failed) leaves
    the trace's own how-to for a trace without steps in place."""
    from servprof.analysis import merged_missing

    no_step = {"what": "model steps", "message": "No model step was found in this trace: mark each step ..."}
    compiled = {"what": "automatic model steps", "message": "A torch.compile'd model runs in this process ..."}
    no_forward = {"what": "automatic model steps",
                  "message": "No torch.nn.Module forward ran in this process while the session captured: ..."}
    assert merged_missing([compiled], [no_step]) == [compiled, no_step]
    assert merged_missing([no_forward], [no_step]) == [no_forward]


def test_forwards_under_way_when_a_session_starts_say_the_model_is_here() -> None:
    """A session that ends before any step begins (on a GPU a busy server's kernels can fill a light
    session's event budget within one step) saw the model's modules run, inside forwards begun before
    it: the model is in this process, and the entry must not send the user to another one."""
    import threading

    import torch

    from servprof.analysis import merged_missing
    from servprof.auto import AutoInstrumentation
    from servprof.trace.meta import NO_FORWARD_LEAD, NO_STEP_BEGAN_LEAD

    inside, release = threading.Event(), threading.Event()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.first(x)
            inside.set()
            release.wait(10)  # the session starts here, in the middle of this forward
            return self.second(x)

    model = Model()
    worker = threading.Thread(target=model, args=(torch.ones(1, 4),))
    worker.start()
    assert inside.wait(10)
    auto = AutoInstrumentation()
    auto.start(lambda: [], None)
    try:
        release.set()
        worker.join(10)
    finally:
        auto.stop()
        auto.remove()
    assert auto.steps.steps == 0 and auto.steps.module_calls >= 1
    for budget_spent, advice in ((True, "SERVPROF_MAX_SESSION_EVENTS"), (False, "SERVPROF_REQUESTS_PER_SESSION")):
        (entry,) = [m for m in auto.missing(budget_spent) if m["what"] == "automatic model steps"]
        assert entry["message"].startswith(NO_STEP_BEGAN_LEAD), entry
        assert "the model runs in this process" in entry["message"] and advice in entry["message"]
        assert "another process" not in entry["message"]
        # It stands for the trace's generic "no step: mark your steps" as the no-forward entry does.
        no_step = {"what": "model steps", "message": "No model step was found in this trace: mark each step ..."}
        assert merged_missing([entry], [no_step]) == [entry]
    # With no module call at all, the no-forward entry as before.
    auto.steps.module_calls = 0
    assert auto.missing()[0]["message"].startswith(NO_FORWARD_LEAD)
