"""tokenization_stall on small synthetic traces: its fix, severity by share, servprof's stop,
and what it says when a trace shows no tokenization at all."""

from __future__ import annotations

from pathlib import Path

from _kineto_builder import KinetoTrace

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

ENGINE, LOOP = 1, 2


def _trace(tokenize_ms: float, metadata: dict | None = None, queue_ms: float = 0.1) -> KinetoTrace:
    trace = KinetoTrace()
    trace.metadata = metadata or {}
    trace.host("servprof:tokenize|r1", 0.0, tokenize_ms * 1000, tid=LOOP)
    t = (tokenize_ms + queue_ms) * 1000
    trace.host("servprof:prefill|r1", t, 2000)
    for _ in range(6):
        t += 2100
        trace.host("servprof:decode_step|r1", t, 2000)
        trace.host("aten::mm", t, 1900)
    return trace


def test_a_short_stall_is_a_warning_and_says_what_to_do(tmp_path: Path):
    (stall,) = [f for f in analyse(load_trace(_trace(8.0).write(tmp_path / "t.json"))).findings
                if f.kind == "tokenization_stall"]
    # 8 ms of 8.1 ms to the first step: most of it, but 8 ms is not critical.
    assert stall.severity == "warning" and stall.fix
    long = [f for f in analyse(load_trace(_trace(60.0).write(tmp_path / "u.json"))).findings
            if f.kind == "tokenization_stall"]
    assert long[0].severity == "critical"


def test_a_few_ms_that_are_a_minor_share_of_the_wait_are_info(tmp_path: Path):
    """6 ms of tokenizing, then 24 ms in the queue: noted, not called worth fixing (a busy host
    stretches a ~1 ms call that far); 12 ms in the same place is a warning."""
    (small,) = [f for f in analyse(load_trace(_trace(6.0, queue_ms=24.0).write(tmp_path / "s.json"))).findings
                if f.kind == "tokenization_stall"]
    assert small.severity == "info" and small.evidence["share_of_time_to_first_step"] < 0.5 and small.fix
    (longer,) = [f for f in analyse(load_trace(_trace(12.0, queue_ms=24.0).write(tmp_path / "l.json"))).findings
                 if f.kind == "tokenization_stall"]
    assert longer.severity == "warning"


def test_tokenization_after_servprofs_stop_is_not_the_apps(tmp_path: Path):
    base_ns = 1_700_000_000_000_000
    meta = {"baseTimeNanoseconds": base_ns, "servprof": {"stop_wall_ns": base_ns + 40_000_000}}
    (stall,) = [f for f in analyse(load_trace(_trace(60.0, meta).write(tmp_path / "t.json"))).findings
                if f.kind == "tokenization_stall"]
    assert stall.evidence["tokenize_ms"] == 40.0 and stall.end_us == 40000.0


def test_no_tokenization_in_the_trace_says_how_to_get_it(tmp_path: Path):
    trace = KinetoTrace()
    for k in range(4):
        trace.host("servprof:decode_step|r1", k * 2100.0, 2000)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    # (The bandwidth detector also says it has no op shapes here; only one entry is about tokenization.)
    (entry,) = [m for m in analysis.summary["missing"] if m["what"] == "tokenization"]
    assert "servprof.phase(\"tokenize\")" in entry["message"] and "tiktoken" in entry["message"]


def test_the_title_promises_a_first_model_step_only_when_the_trace_has_one(tmp_path: Path):
    """A batch's tokenizer call names no request, and a request may have no step of its own in the
    trace: neither is said to come 'before its first model step'."""
    trace = KinetoTrace()
    trace.host("servprof:tokenize", 0.0, 12_000.0, tid=ENGINE)  # a batch's call: no request named
    trace.host("servprof:tokenize|r2", 20_000.0, 12_000.0, tid=LOOP)  # r2: no step after it
    for k in range(4):
        trace.host("servprof:decode_step|r1", 40_000.0 + k * 2100.0, 2000)
    titles = {f.evidence["request_id"]: f.title for f in analyse(load_trace(trace.write(tmp_path / "t.json"))).findings
              if f.kind == "tokenization_stall"}
    assert titles[None] == "a tokenizer call spent 12.0 ms tokenizing (it names no request: a batch's, or outside any request)"
    assert titles["r2"] == "request r2 spent 12.0 ms tokenizing (no model step of its own after it in the trace)"
    (before,) = [f for f in analyse(load_trace(_trace(8.0).write(tmp_path / "u.json"))).findings
                 if f.kind == "tokenization_stall"]
    assert before.title == "request r1 spent 8.0 ms tokenizing before its first model step"


def test_a_tokenization_beside_other_threads_model_steps_says_so_and_what_to_try(tmp_path: Path):
    """A server that runs each request's model call on its own thread: r3 tokenizes on its thread
    while r1's and r2's forwards run on two others. The title says which threads' steps covered how
    much of it, and the fix starts from the contention (the tokenizer may be starved, not slow); a
    tokenization with nothing running beside it keeps the slow-tokenizer fix."""
    trace = KinetoTrace()
    trace.host("servprof:prefill|r1", 0.0, 30_000.0, tid=11)
    trace.host("servprof:prefill|r2", 2_000.0, 7_000.0, tid=12)
    trace.host("servprof:prefill|r2", 12_000.0, 30_000.0, tid=12)
    trace.host("servprof:tokenize|r3", 5_000.0, 8_000.0, tid=13)  # covered by r1 all through, r2 in part
    trace.host("servprof:prefill|r3", 13_100.0, 20_000.0, tid=13)
    trace.host("servprof:tokenize|r4", 60_000.0, 8_000.0, tid=14)  # alone
    trace.host("servprof:prefill|r4", 68_100.0, 20_000.0, tid=14)
    stalls = {f.evidence["request_id"]: f for f in analyse(load_trace(trace.write(tmp_path / "t.json"))).findings
              if f.kind == "tokenization_stall"}
    beside, alone = stalls["r3"], stalls["r4"]
    assert beside.evidence["other_steps"] == {"us": 8000.0, "threads": 2}
    assert beside.title == ("request r3 spent 8.0 ms tokenizing before its first model step; model steps ran on 2 "
                            "other thread(s) for 8.0 ms of it")
    assert beside.fix.startswith("It ran while model calls on other threads") and "time the same call alone" in beside.fix
    assert alone.evidence["other_steps"] == {"us": 0.0, "threads": 0}
    assert alone.title == "request r4 spent 8.0 ms tokenizing before its first model step"
    assert alone.fix.startswith("Use a fast (Rust) tokenizer")


def test_reading_the_tokenizers_output_is_not_tokenization(tmp_path: Path):
    """A with_stack trace of a generate loop shows `inputs["input_ids"]` and `.to(device)` as
    frames in transformers' tokenization_utils_base.py (BatchEncoding's methods): no tokenization
    ran, so none is counted and the trace still says it shows none; the tokenizer's own call in
    the same file is one."""
    trace = KinetoTrace()
    for k in range(4):
        trace.frame("transformers/tokenization_utils_base.py(269): __getitem__", k * 2100.0, 1.0)
        trace.frame("transformers/tokenization_utils_base.py(812): to", k * 2100.0 + 2.0, 3.0)
        trace.host("servprof:decode_step|r1", k * 2100.0 + 10.0, 2000)
    summary = analyse(load_trace(trace.write(tmp_path / "t.json"))).summary
    assert summary["tokenization"]["tokenizations"] == 0
    assert "tokenization" in [m["what"] for m in summary["missing"]]
    trace.frame("transformers/tokenization_utils_base.py(2851): __call__", 9000.0, 6000.0)
    summary = analyse(load_trace(trace.write(tmp_path / "u.json"))).summary
    assert summary["tokenization"]["tokenizations"] == 1


def test_one_engine_threads_steps_beside_a_tokenization_count_too(tmp_path: Path):
    """One engine thread runs every step; a request tokenizes on its own thread meanwhile: the
    engine's steps covered it (a window on a thread with no step of its own is judged too)."""
    trace = KinetoTrace()
    trace.host("servprof:tokenize|r2", 1_000.0, 8_000.0, tid=LOOP + 10)
    for k in range(6):
        trace.host("servprof:decode_step|r1", k * 2_100.0, 2_000.0, tid=ENGINE)
    trace.host("servprof:prefill|r2", 13_000.0, 2_000.0, tid=ENGINE)
    (stall,) = [f for f in analyse(load_trace(trace.write(tmp_path / "t.json"))).findings
                if f.kind == "tokenization_stall"]
    # Steps at 0-2, 2.1-4.1, 4.2-6.2, 6.3-8.3, 8.4-10.4 ms cover 7.6 of its 8 ms (1-9 ms).
    assert stall.evidence["other_steps"] == {"us": 7600.0, "threads": 1}
    assert stall.fix.startswith("It ran while model calls on other threads")


def test_the_threads_cpu_time_tells_a_waiting_tokenizer_from_a_slow_one(tmp_path: Path):
    """servprof sessions time each tokenizer call of one text (servprof.auto.tokenizers): r3's
    thread ran 1 ms of its 8 ms call beside other threads' steps (it waited: the fix is what it
    waited for, not the tokenizer); r4's ran 7.8 of 8 ms beside the same steps (the tokenizer
    worked: slow, whatever ran beside it); r5's call was not timed (the contention hint stands);
    a damaged entry is skipped."""
    base_ns, wall0, perf0 = 1_700_000_000_000_000_000, 1_700_000_000_000_500_000, 9_000_000_000

    def timed(tid: int, start_us: float, wall_ms: float, cpu_ms: float) -> list[int]:
        # perf_counter_ns of a call starting at trace µs start_us (trace µs = (unix ns - base) / 1000)
        return [tid, int(perf0 + (base_ns + start_us * 1000) - wall0), int(wall_ms * 1e6), int(cpu_ms * 1e6)]

    trace = KinetoTrace()
    trace.metadata = {"baseTimeNanoseconds": base_ns, "servprof": {
        "wall_start_ns": wall0, "perf_start_ns": perf0,
        "auto": {"tokenizer_cpu_ns": [timed(13, 5_020.0, 7.95, 1.0), timed(14, 40_010.0, 7.98, 7.8),
                                      [15, "x", 1, 2], "bad"]}}}
    for start in (0.0, 35_000.0, 70_000.0):  # other threads' model steps under every tokenization
        trace.host("servprof:prefill|r1", start, 30_000.0, tid=11)
    trace.host("servprof:tokenize|r3", 5_000.0, 8_000.0, tid=13)
    trace.host("servprof:prefill|r3", 13_100.0, 20_000.0, tid=13)
    trace.host("servprof:tokenize|r4", 40_000.0, 8_000.0, tid=14)
    trace.host("servprof:prefill|r4", 48_100.0, 20_000.0, tid=14)
    trace.host("servprof:tokenize|r5", 75_000.0, 8_000.0, tid=15)
    trace.host("servprof:prefill|r5", 83_100.0, 20_000.0, tid=15)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    stalls = {f.evidence["request_id"]: f for f in analysis.findings if f.kind == "tokenization_stall"}
    waited, slow, unmeasured = stalls["r3"], stalls["r4"], stalls["r5"]
    assert waited.evidence["thread_cpu_ms"] == 1.0
    assert waited.title == ("request r3 spent 8.0 ms tokenizing before its first model step; its thread ran on a CPU "
                            "for 1.0 ms of it and waited the rest (the GIL, a CPU, I/O): the tokenizer is not what "
                            "is slow")
    assert waited.fix.startswith("The tokenizer is not what is slow")
    assert slow.evidence["thread_cpu_ms"] == 7.8 and slow.evidence["other_steps"]["threads"] == 1
    assert slow.title == "request r4 spent 8.0 ms tokenizing before its first model step"
    assert slow.fix.startswith("Use a fast (Rust) tokenizer")
    assert unmeasured.evidence["thread_cpu_ms"] is None and unmeasured.fix.startswith("It ran while model calls")
    assert analysis.summary["tokenization"]["per_request"]["r3"]["thread_cpu_ms"] == 1.0
