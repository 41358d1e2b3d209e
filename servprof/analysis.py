"""Analysis of one session's trace, in a child process, and the serving side's hand-off.

The serving process never parses traces: it hands each session to a warm worker process,

    python -m servprof.analysis --serve      (analysis_worker.py: one job per line, reused)

with a timeout (``run_analysis``, called on the capture thread). The worker loads the trace
with ``servprof.trace.load_trace`` (its size and gzip-bomb guards apply) and runs the
detectors; if a detector fails, the phase timings are still reported. One trace can also be
analysed on its own, as a fresh child would:

    python -m servprof.analysis <trace.json.gz> <session.json> <result.json>

The result format is the one in docs/CONTRACTS.md.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from servprof.analysis_worker import (
    CHILD_NICENESS,
    IDLE_EXIT_S,
    MAX_JOBS,
    RETIRE_RSS_BYTES,
    SETTINGS_PREFIX,
    WORKERS,
    JobFailed,
)
from servprof.detect.missing import merged_missing
from servprof.trace.allocator import keep_freed_memory_for_reuse


def kill_running_analyses() -> None:
    WORKERS.kill_all()


def empty_result(session_id: str, trace_path: Path | None, error: str | None = None,
                 summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """A result with no requests and no findings: a failed or a skipped analysis."""
    return {"session_id": session_id, "trace_file": str(trace_path) if trace_path else None, "error": error,
            "requests": {}, "findings": [], "summary": summary or {}, "clock": {}}


def failed_result(session_id: str, trace_path: Path | None, error: str) -> dict[str, Any]:
    return empty_result(session_id, trace_path, error)


def run_analysis(session_id: str, trace_path: Path, session_path: Path, result_path: Path,
                 timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Have the worker analyse the trace; always returns a result dict, with ``error`` set when the
    analysis failed.

    Blocking: call it from a worker thread. A job that crashes or hangs its worker kills it (the
    next session gets a fresh one), so it never poisons the next session. ``should_stop`` is asked
    once the job's worker is registered: a shutdown that ran kill_running_analyses() just before
    then is not missed.
    """
    result_path.unlink(missing_ok=True)
    job = {"trace": str(trace_path), "session": str(session_path), "result": str(result_path)}
    try:
        reply = WORKERS.run(job, timeout_s, should_stop)
    except JobFailed as exc:
        return failed_result(session_id, trace_path, str(exc))
    if not reply.get("ok"):
        # (The worker lives on: a trace it could not read fails that session alone.)
        return failed_result(session_id, trace_path, str(reply.get("error") or "servprof analysis failed"))
    try:
        result = orjson.loads(result_path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        return failed_result(session_id, trace_path, f"analysis output unreadable: {exc}")
    problem = _shape_problem(result, session_id)
    if problem:
        return failed_result(session_id, trace_path, f"analysis output invalid: {problem}")
    return result


def _shape_problem(result: Any, session_id: str) -> str | None:
    if not isinstance(result, dict):
        return f"expected a JSON object, got {type(result).__name__}"
    if result.get("session_id") != session_id:
        return f"session_id {result.get('session_id')!r} is not {session_id!r}"
    if not isinstance(result.get("requests"), dict):
        return "'requests' is not an object"
    if not isinstance(result.get("findings"), list):
        return "'findings' is not a list"
    if result.get("error") is not None and not isinstance(result["error"], str):
        return "'error' is neither null nor a string"
    return None


# --- the child -----------------------------------------------------------------------------------


def steps_by_request(steps: list[Any], session: dict[str, Any], base_ns: int) -> dict[str, Any]:
    """Each sampled request's model steps, by time window (trace µs = (unix ns - base) / 1000).
    One rank's steps are enough: every rank runs the same steps."""
    if not steps:
        return {}
    rank = min(step.rank for step in steps)
    session_end_ns = (session.get("wall_start_ns") or 0) + int((session.get("duration_s") or 0) * 1e9)
    names = {"decode": "decode_step", "prefill": "prefill"}
    requests: dict[str, Any] = {}
    for record in session.get("requests", []):
        arrival, arrival_perf = record.get("arrival_ns"), record.get("arrival_perf_ns")
        if not isinstance(arrival, int) or not isinstance(arrival_perf, int):
            continue
        end = record.get("end_ns")
        end_ns = arrival + (end - arrival_perf) if isinstance(end, int) else session_end_ns
        lo, hi = (arrival - base_ns) / 1e3, (end_ns - base_ns) / 1e3
        phases = [{"name": names.get(step.kind, "model_step"), "start_us": step.start_us, "end_us": step.end_us}
                  for step in steps if step.rank == rank and step.start_us < hi and step.end_us > lo]
        if phases:
            requests[str(record["request_id"])] = {"phases": phases, "phases_from": "time window"}
    return requests


def analyse(trace_path: Path, session: dict[str, Any]) -> dict[str, Any]:
    """The result for one session's trace. A trace servprof.trace refuses fails the child
    (one line, TraceError); a detector that fails still leaves the phase timings."""
    from servprof.detect.analysis import analyse as run_all_detectors
    from servprof.trace import load_trace, request_phases

    trace = load_trace(trace_path, read_args=True)  # (every detector runs: they read args)
    base_ns = trace.base_time_ns()  # None when absent or not a number (never a traceback)
    requests = {rid: {"phases": phases} for rid, phases in request_phases(trace).items()}
    findings: list[Any] = []
    summary: dict[str, Any] = {"event_count": len(trace)}
    try:
        detected = run_all_detectors(trace, session.get("requests", []))
    except Exception as exc:  # noqa: BLE001 - a detector bug still leaves the phase timings
        summary["detectors"] = f"failed: {type(exc).__name__}: {exc}"
    else:
        findings = [f.to_dict() for f in detected.findings]
        summary.update({"detectors": "servprof.detect", "detect": detected.summary,
                        # The contract's top-level keys (docs/CONTRACTS.md) for status and the reports.
                        "missing": detected.summary.get("missing", []),
                        "servprof_overhead": detected.summary.get("servprof_overhead")})
        if not requests and isinstance(base_ns, (int, float)):
            # Traces without servprof's phase markers (vLLM's workers) still show the model steps
            # each sampled request was in flight for.
            requests = steps_by_request(detected.steps, session, int(base_ns))
    summary["missing"] = merged_missing(trace.servprof_metadata().get("missing"), summary.get("missing"),
                                        (summary.get("detect") or {}).get("missing"))
    sampled = [r.get("request_id") for r in session.get("requests", [])]
    # Two different counts, named apart: the body chunks the sampled requests had streamed when the
    # capture stopped (the session's estimate of decode steps) and the model steps in the trace.
    model_steps = ((summary.get("detect") or {}).get("steps") or {}).get("count")
    summary.update({"sampled_request_ids": sampled, "requests_with_phases": len(requests),
                    "stop_reason": session.get("stop_reason"), "duration_s": session.get("duration_s"),
                    "steps_streamed_at_stop": session.get("steps_streamed_at_stop"), "model_steps": model_steps,
                    "servprof_overhead_ms": session.get("servprof_overhead_ms") or {}})
    clock = {"trace_us_to_unix_ns_offset": int(base_ns)} if isinstance(base_ns, (int, float)) else {}
    return {"session_id": str(session.get("session_id", "")), "trace_file": str(trace_path), "error": None,
            "requests": requests, "findings": findings, "summary": summary, "clock": clock}


def main(argv: list[str]) -> int:
    keep_freed_memory_for_reuse()  # (a process that only analyses: trace/allocator.py)
    if argv == ["--serve"]:
        _lower_priority()
        replies = _own_stdout()
        import servprof.detect.analysis  # noqa: F401 - a worker imports once, before its first job
        return serve(sys.stdin.buffer, replies)
    if len(argv) != 3:
        print("usage: python -m servprof.analysis TRACE SESSION_JSON RESULT_JSON  (or --serve)", file=sys.stderr)
        return 2
    _lower_priority()
    error = _analyse_to_file(*(Path(a) for a in argv))
    if error is not None:
        print(error, file=sys.stderr)
        return 1
    return 0


def serve(jobs: IO[bytes], replies: IO[bytes], idle_exit_s: float = IDLE_EXIT_S, max_jobs: int = MAX_JOBS,
          retire_bytes: int = RETIRE_RSS_BYTES) -> int:
    """The worker's loop: one job per line (JSON: trace, session, result, env; ``retire``: the last
    one), one reply per line (``{"ok": bool, "error": str | null, "retire": bool}``). Ends when its
    input closes (the serving process is gone), after ``idle_exit_s`` without a job, or after a job
    that retires it."""
    done = 0
    while True:
        ready, _, _ = select.select([jobs], [], [], idle_exit_s)
        line = jobs.readline() if ready else b""
        if not line:
            return 0
        try:
            job = orjson.loads(line)
            paths = [Path(job[key]) for key in ("trace", "session", "result")]
            settings = {str(k): str(v) for k, v in job.get("env", {}).items() if str(k).startswith(SETTINGS_PREFIX)}
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            job, error = {}, f"servprof analysis: a job it cannot read ({type(exc).__name__})"
        else:
            with _settings(settings):
                error = _analyse_to_file(*paths)
        done += 1
        retire = done >= max_jobs or job.get("retire") is True or _resident_bytes() > retire_bytes
        replies.write(orjson.dumps({"ok": error is None, "error": error, "retire": retire}) + b"\n")
        replies.flush()
        if retire:
            return 0


@contextlib.contextmanager
def _settings(settings: dict[str, str]) -> Iterator[None]:
    """The serving process's SERVPROF_* settings as they are now (the worker's own replaced), as a
    fresh child would read them; the environment as it was afterwards."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update({**{k: v for k, v in before.items() if not k.startswith(SETTINGS_PREFIX)}, **settings})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _analyse_to_file(trace_path: Path, session_path: Path, result_path: Path) -> str | None:
    """Analyse one trace into ``result_path`` (mode 0600); the error's one line, or None."""
    try:
        session = orjson.loads(session_path.read_bytes())
        result = analyse(trace_path, session)
    except Exception as exc:  # noqa: BLE001 - one clear line for the parent's status, not a traceback
        return f"servprof analysis failed: {type(exc).__name__}: {exc}"
    try:
        fd = os.open(result_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    except OSError as exc:
        return f"servprof analysis failed: cannot write {result_path}: {exc.strerror}"
    return None


def _own_stdout() -> IO[bytes]:
    """The replies' channel: stdout, kept for them alone. Whatever else writes to it (a print in a
    library, a C library's output) goes to stderr instead of corrupting a reply."""
    sys.stdout.flush()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


def _lower_priority() -> None:
    with contextlib.suppress(OSError):
        if os.nice(0) < CHILD_NICENESS:  # started without `nice`
            os.nice(CHILD_NICENESS - os.nice(0))


def _resident_bytes() -> int:
    """The memory the worker holds now (what a big trace's analysis leaves resident). Not the peak:
    a child's peak starts at the serving process's size, copied at the fork before its exec."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: MAX_JOBS alone retires it
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
