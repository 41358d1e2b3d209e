"""Event-loop stalls: what blocked the serving loop, named by its Python frames.

The serving process's watchdog (servprof.watchdog) writes the stalls it saw into the
session trace's ``servprof`` metadata (key ``loop_stalls``, docs/CONTRACTS.md): when,
how long, the loop thread's stacks sampled meanwhile, and the requests in flight. Stalls
are grouped by the blocking function (the innermost frame of the server's own code, else
the innermost frame) into one finding each: ``tokenization_stall`` when the frames are a
tokenizer's (or a tokenize phase ran on the loop thread then), else ``loop_stall``.

Stalls without a sample (a C call held the GIL the whole time) are named from the trace:
the longest range the loop thread ran then. servprof's own work is never blamed: the
watchdog stops before the profiler's ``stop()``, stalls after ``stop_wall_ns`` are
dropped, and a stall whose innermost frame is servprof's (other than its transparent
tokenizer wrappers) is counted apart.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from servprof.detect.causes import TOKENIZER_NAMES
from servprof.detect.finding import Finding, Severity
from servprof.trace.model import Trace
from servprof.trace.phases import phase_events

KIND = "loop_stall"
WARNING_MS = 20.0
CRITICAL_MS = 100.0
MAX_FRAMES_SHOWN = 12
_TOKENIZER_FILES = re.compile(r"[/\\](tokenizers|tiktoken|sentencepiece)[/\\]|tokenization_|[/\\]auto[/\\]tokenizers\.py$")
_AUTO_WRAPPERS = os.sep + "servprof" + os.sep + "auto" + os.sep
_IO_NAMES = re.compile(r"^(sleep|recv|recv_into|send|sendall|connect|read|readinto|readline|getaddrinfo|select|poll|"
                       r"wait|acquire|urlopen|request|get|post|_send_output|begin)$")


def _frames(stall: dict[str, Any]) -> list[dict[str, Any]]:
    stacks = stall.get("stacks") or []
    frames = stacks[0].get("frames") if stacks and isinstance(stacks[0], dict) else None
    return [f for f in frames or [] if isinstance(f, dict)]


def _is_tokenizer_frame(frame: dict[str, Any]) -> bool:
    return bool(TOKENIZER_NAMES.search(str(frame.get("function", "")))
                or _TOKENIZER_FILES.search(str(frame.get("file", ""))))


def _blocking_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame of the server's own code, else the innermost one (servprof's
    transparent tokenizer wrappers skipped)."""
    frames = [f for f in frames if _AUTO_WRAPPERS not in str(f.get("file", ""))]
    for frame in reversed(frames):
        if frame.get("origin") == "app":
            return frame
    return frames[-1] if frames else None


def _loop_ranges(trace: Trace, loop_tid: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if loop_tid is None:
        return np.empty(0, dtype=np.int64), np.empty(0), np.empty(0)
    rows = np.flatnonzero(trace.complete() & (trace.tid == loop_tid) & (trace.stream < 0))
    return rows, trace.ts[rows], trace.ts[rows] + trace.dur[rows]


def detect_loop_stalls(trace: Trace, findings: list[Finding] | None = None) -> tuple[list[Finding], dict[str, Any]]:
    meta = trace.servprof_metadata()
    stalls = [s for s in meta.get("loop_stalls") or [] if isinstance(s, dict)]
    watchdog = meta.get("watchdog") if isinstance(meta.get("watchdog"), dict) else None
    summary: dict[str, Any] = {"watched": bool(watchdog and watchdog.get("attached")), "stalls": len(stalls),
                               "servprof_own": 0, "groups": 0}
    if not stalls:
        return [], summary
    base_ns = next((m.get("baseTimeNanoseconds") for m in trace.metadata.values()
                    if isinstance(m.get("baseTimeNanoseconds"), (int, float))), None)
    if base_ns is None:
        summary["problem"] = "the trace has no baseTimeNanoseconds: stalls cannot be placed in it"
        return [], summary
    stop_ns = meta.get("stop_wall_ns")
    loop_tid = meta.get("event_loop_tid") or (watchdog or {}).get("loop_tid")
    rows, starts, ends = _loop_ranges(trace, loop_tid if isinstance(loop_tid, int) else None)
    tokenize = [e for e in phase_events(trace) if e.phase == "tokenize" and e.tid == loop_tid]

    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for stall in stalls:
        start_ns, end_ns = stall.get("start_wall_ns"), stall.get("end_wall_ns")
        if not isinstance(start_ns, int) or not isinstance(end_ns, int) or end_ns <= start_ns:
            continue
        if isinstance(stop_ns, int) and start_ns >= stop_ns:
            summary["servprof_own"] += 1  # during the profiler's own stop(): servprof's overhead
            continue
        start_us, end_us = (start_ns - base_ns) / 1e3, (end_ns - base_ns) / 1e3
        frames = _frames(stall)
        blocking = _blocking_frame(frames)
        if blocking is not None and blocking.get("origin") == "servprof":
            summary["servprof_own"] += 1
            continue
        tokenizing = any(_is_tokenizer_frame(f) for f in frames) or any(
            e.start_us < end_us and e.end_us > start_us for e in tokenize)
        if blocking is not None:
            key = (str(blocking.get("function")), str(blocking.get("file")))
            named_by = "python frames"
        else:
            overlap = (np.minimum(ends, end_us) - np.maximum(starts, start_us)) if rows.size else np.empty(0)
            if overlap.size and overlap.max() > 0:
                row = int(rows[int(np.argmax(overlap))])
                key = (trace.name(row), "")
                named_by = "the trace (no Python frame could be sampled: a C call held the GIL)"
            else:
                key = ("<unknown>", "")
                named_by = "nothing: no frame was sampled and the trace shows nothing on the loop thread"
        group = groups.setdefault(key, {"stalls": [], "tokenizing": False, "frames": frames, "blocking": blocking,
                                        "named_by": named_by, "request_ids": [], "blocking_request_ids": []})
        group["tokenizing"] |= tokenizing
        group["stalls"].append({"start_us": start_us, "end_us": end_us, "duration_ms": float(stall.get("duration_ms")
                                                                                             or 0.0),
                                "in_flight": stall.get("in_flight"), "samples": stall.get("samples", 0),
                                "blocking_request_id": stall.get("blocking_request_id")})
        if len(frames) > len(group["frames"]):
            group["frames"] = frames
        for rid in stall.get("request_ids") or []:
            if isinstance(rid, str) and rid not in group["request_ids"]:
                group["request_ids"].append(rid)
        rid = stall.get("blocking_request_id")
        if isinstance(rid, str) and rid not in group["blocking_request_ids"]:
            group["blocking_request_ids"].append(rid)

    watched_ms = float((watchdog or {}).get("watched_s") or 0.0) * 1e3
    out: list[Finding] = []
    for (function, path), group in groups.items():
        finding = _finding(function, path, group, watched_ms)
        merged = _merge_into_tokenization(finding, findings or [])
        if not merged:
            out.append(finding)
    summary["groups"] = len(groups)
    summary["stall_ms_total"] = round(sum(s["duration_ms"] for g in groups.values() for s in g["stalls"]), 3)
    summary["stall_ms_max"] = round(max((s["duration_ms"] for g in groups.values() for s in g["stalls"]),
                                        default=0.0), 3)
    return out, summary


def _finding(function: str, path: str, group: dict[str, Any], watched_ms: float) -> Finding:
    stalls = group["stalls"]
    total = sum(s["duration_ms"] for s in stalls)
    longest = max(s["duration_ms"] for s in stalls)
    blocking = group["blocking"] or {}
    where = f"{function} ({os.path.basename(path)}:{blocking.get('line')})" if path else function
    in_flight = max((s["in_flight"] for s in stalls if isinstance(s["in_flight"], int)), default=None)
    severity: Severity = "info"
    if longest >= CRITICAL_MS or (watched_ms and total >= 0.25 * watched_ms):
        severity = "critical"
    elif longest >= WARNING_MS:
        severity = "warning"
    kind = "tokenization_stall" if group["tokenizing"] else KIND
    times = f"{len(stalls)} time{'s' if len(stalls) != 1 else ''}"
    delayed = f", with {in_flight} request(s) in flight" if in_flight else ""
    title = (f"{where} blocked the event loop {times}, {total:.1f} ms in all (longest {longest:.1f} ms){delayed}"
             + ("; it is tokenization" if kind == "tokenization_stall" else ""))
    frames = group["frames"][-MAX_FRAMES_SHOWN:]
    return Finding(
        kind=kind, severity=severity, cost_ms=total,
        start_us=min(s["start_us"] for s in stalls), end_us=max(s["end_us"] for s in stalls),
        title=title,
        request_ids=[*group["blocking_request_ids"], *(r for r in group["request_ids"]
                                                       if r not in group["blocking_request_ids"])][:100],
        evidence={"source": "event-loop watchdog", "function": function, "file": path or None,
                  "line": blocking.get("line"), "named_by": group["named_by"], "stalls": len(stalls),
                  "stall_ms_total": round(total, 3), "stall_ms_max": round(longest, 3),
                  "in_flight_max": in_flight, "blocking_request_ids": group["blocking_request_ids"],
                  "delayed_request_ids": group["request_ids"][:100], "frames": frames,
                  "examples": sorted(stalls, key=lambda s: -s["duration_ms"])[:10]},
        fix=_fix(function, where, kind, longest),
    )


def _fix(function: str, where: str, kind: str, longest: float) -> str:
    if kind == "tokenization_stall":
        return (f"Tokenize off the event loop: call it through `await asyncio.to_thread(...)` (or "
                f"`anyio.to_thread.run_sync`), or a process pool if {where} is pure Python; every request "
                f"in flight waits up to {longest:.0f} ms while it runs on the loop.")
    if _IO_NAMES.match(function):
        return (f"{where} waits on the event loop: use its async form (an async HTTP client, "
                f"`await asyncio.sleep`, an async driver) or run it with `await asyncio.to_thread(...)`.")
    return (f"Move {where} off the event loop: `await asyncio.to_thread(...)` for code that releases the GIL "
            f"(I/O, NumPy, torch), a process pool for pure-Python work; every request in flight waits up to "
            f"{longest:.0f} ms while it runs.")


def _merge_into_tokenization(finding: Finding, findings: list[Finding]) -> bool:
    """A tokenization stall the phase detector already reported for the same time gets the
    frames as evidence instead of a second finding."""
    if finding.kind != "tokenization_stall":
        return False
    for other in findings:
        if other.kind != "tokenization_stall" or other.evidence.get("source") == "event-loop watchdog":
            continue
        overlap = min(other.end_us, finding.end_us) - max(other.start_us, finding.start_us)
        if overlap > 0.5 * (finding.end_us - finding.start_us):
            other.evidence["loop_stall"] = {k: finding.evidence[k] for k in
                                            ("function", "file", "line", "stalls", "stall_ms_max", "frames")}
            return True
    return False
