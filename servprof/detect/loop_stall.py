"""Event-loop stalls: what blocked the serving loop, named by its Python frames.

The serving process's watchdog (servprof.watchdog) writes the stalls it saw into the
session trace's ``servprof`` metadata (key ``loop_stalls``, docs/CONTRACTS.md): when,
how long, the loop thread's stacks sampled meanwhile, and the requests in flight.

Each sampled stack is read from the innermost frame outwards: the first frame that is
neither a library's (stdlib, site-packages) nor one of servprof's transparent wrappers
(its tokenizer patches, its thread-start patch) names the blocking function; if that is
servprof's own code the sample is servprof's, never the app's. Stalls are grouped by
their blocking function into one finding each: ``tokenization_stall`` when the frames are
a tokenizer's (or a tokenize phase ran on the loop thread then), else ``loop_stall``.

A stall with no stack of its own is named from what the watchdog saw: the loop in its
selector (it waited for the GIL or for a CPU: another thread ran), or no sample at all (a
C call held the GIL the whole time: the trace's range on the loop thread covering most of
the stall names it, when there is one). Stalls after ``stop_wall_ns`` are servprof's.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

import numpy as np

from servprof.detect.cause_texts import CAUSES
from servprof.detect.causes import TOKENIZER_NAMES
from servprof.detect.finding import Finding, Severity
from servprof.detect.intervals import covered_within
from servprof.trace.meta import loop_thread
from servprof.trace.model import Trace
from servprof.trace.phases import parse_phase_event_name, phase_events, split_auto

KIND = "loop_stall"
WARNING_MS = 20.0
CRITICAL_MS = 100.0
MAX_FRAMES_SHOWN = 12
MIN_RANGE_COVER = 0.5  # a trace range names a frameless stall when it covers this share of it
ENCLOSING = 4.0  # ... and lasts at most this many times the stall
WAITING = "(waiting to run: another thread held the GIL or the CPUs were busy)"
UNSAMPLED = "(no sample: a C call held the GIL, or the watchdog got no CPU)"
# A stall with no Python frame sampled, that Python's garbage collector covered (servprof's ranges
# around its collections, on any thread: it holds the GIL, the loop's and the watchdog's alike).
GARBAGE_COLLECTOR = "Python's garbage collector"
_SEP = re.escape(os.sep)
_TRANSPARENT = re.compile(rf"{_SEP}servprof{_SEP}auto{_SEP}")
_TOKENIZER_FILES = re.compile(rf"{_SEP}(tokenizers|tiktoken|sentencepiece){_SEP}|tokenization_|"
                              rf"{_SEP}servprof{_SEP}auto{_SEP}tokenizers\.py$")
_IO_NAMES = re.compile(r"^(sleep|recv|recv_into|send|sendall|connect|read|readinto|readline|getaddrinfo|select|poll|"
                       r"wait|acquire|urlopen|request|get|post|_send_output|begin)$")


def _is_tokenizer_frame(frame: dict[str, Any]) -> bool:
    return bool(TOKENIZER_NAMES.search(str(frame.get("function", "")))
                or _TOKENIZER_FILES.search(str(frame.get("file", ""))))


def classify_stack(frames: list[dict[str, Any]]) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(owner "app" | "servprof" | "library", blocking frame, innermost frame) of one stack."""
    frames = [f for f in frames if isinstance(f, dict) and not _TRANSPARENT.search(str(f.get("file", "")))]
    innermost = frames[-1] if frames else None
    for frame in reversed(frames):
        origin = frame.get("origin")
        if origin in ("app", "servprof"):
            return str(origin), frame, innermost
    return "library", innermost, innermost


def _weight(stack: Any) -> float:
    """The time one sampled stack stands for: its ``ms`` (each sample weighted by the time since
    the one before), or its sample count in traces written before the watchdog kept times."""
    if not isinstance(stack, dict):
        return 1.0
    ms = stack.get("ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:
        return float(ms)
    count = stack.get("count")
    return float(count) if isinstance(count, (int, float)) and not isinstance(count, bool) and count > 0 else 1.0


def _range_label(name: str) -> str:
    parsed = parse_phase_event_name(name)
    if parsed is None:
        return name
    phase, auto = split_auto(parsed[0])
    return f"the {phase} phase ({'marked by servprof' if auto else 'marked by the server'})"


class _Group:
    def __init__(self, function: str, path: str, line: Any, named_by: str):
        self.function, self.path, self.line, self.named_by = function, path, line, named_by
        self.stalls: list[dict[str, Any]] = []
        self.tokenizing = False
        self.frames: list[dict[str, Any]] = []
        self.innermost: dict[str, Any] | None = None
        self.biggest = 0.0  # time (or samples) of the stack shown
        self.functions: Counter[str] = Counter()
        self.request_ids: list[str] = []
        self.blocking_request_ids: list[str] = []


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
    loop_tid = loop_thread(meta)
    rows = np.flatnonzero(trace.complete() & (trace.tid == loop_tid) & (trace.stream < 0)) if loop_tid is not None \
        else np.empty(0, dtype=np.int64)
    starts, ends = trace.ts[rows], trace.ts[rows] + trace.dur[rows]
    phases = phase_events(trace)
    tokenize = [e for e in phases if e.phase == "tokenize" and e.tid == loop_tid]
    collections = [e for e in phases if e.phase == "gc"]
    gc_start, gc_end = np.array([e.start_us for e in collections]), np.array([e.end_us for e in collections])

    groups: dict[tuple[str, str], _Group] = {}
    for stall in stalls:
        start_ns, end_ns = stall.get("start_wall_ns"), stall.get("end_wall_ns")
        if not isinstance(start_ns, int) or not isinstance(end_ns, int) or end_ns <= start_ns:
            continue
        if isinstance(stop_ns, int) and start_ns >= stop_ns:
            summary["servprof_own"] += 1  # the profiler's own stop(): servprof's overhead
            continue
        start_us, end_us = (start_ns - base_ns) / 1e3, (end_ns - base_ns) / 1e3
        owners: Counter[str] = Counter()  # time (ms) per owner, or samples in traces without it
        # A function's samples count together whatever line they were at: a pure-Python loop
        # spreads over several lines, a call into C sits on one.
        functions: Counter[tuple[str, str]] = Counter()
        lines: Counter[tuple[str, str, Any]] = Counter()
        # Per blocking function, its stack with the most time: the one shown when it names the stall.
        biggest: dict[tuple[str, str], tuple[float, list[dict[str, Any]], dict[str, Any] | None]] = {}
        tokenizer_samples: Counter[tuple[str, str]] = Counter()
        for stack in stall.get("stacks") or []:
            frames = [f for f in (stack.get("frames") or []) if isinstance(f, dict)] if isinstance(stack, dict) else []
            count = _weight(stack)
            owner, blocking, innermost = classify_stack(frames)
            owners[owner] += count
            if owner == "servprof" or blocking is None:
                continue
            key = (str(blocking.get("function")), str(blocking.get("file")))
            functions[key] += count
            lines[(*key, blocking.get("line"))] += count
            if any(_is_tokenizer_frame(f) for f in frames):
                tokenizer_samples[key] += count
            if count > biggest.get(key, (0.0,))[0]:
                biggest[key] = (count, frames, innermost)
        if owners and owners["servprof"] * 2 > sum(owners.values()):
            summary["servprof_own"] += 1
            continue
        tokenizing = any(min(e.end_us, end_us) - max(e.start_us, start_us) >= MIN_RANGE_COVER * (end_us - start_us)
                         for e in tokenize)  # a tokenize phase covers most of it
        if functions:
            top, top_count = functions.most_common(1)[0]
            function, path = top
            line = max((k for k in lines if k[:2] == top), key=lambda k: lines[k])[2]
            named_by = "python frames"
            # Tokenization when the blocking function's own samples are mostly inside a tokenizer.
            tokenizing = tokenizer_samples[top] * 2 >= top_count
        elif int(stall.get("idle_samples") or 0) > 0:
            function, path, line, named_by = WAITING, "", None, "the watchdog saw the loop in its selector"
        else:
            function, path, line, named_by = UNSAMPLED, "", None, "no sample could be taken"
            if rows.size:
                cover = np.minimum(ends, end_us) - np.maximum(starts, start_us)
                # A range that began long before the stall or lasted much longer is one the loop
                # runs inside (its thread's entry, asyncio.run, with_stack's outer frames): no cause.
                cover[(ends - starts) > ENCLOSING * (end_us - start_us)] = 0.0
                best = int(np.argmax(cover))
                if cover[best] >= MIN_RANGE_COVER * (end_us - start_us):
                    function = _range_label(trace.name(int(rows[best])))
                    named_by = "the trace: the range the loop thread ran then (no Python frame could be sampled)"
        if function in (WAITING, UNSAMPLED) and collections and \
                covered_within(gc_start, gc_end, start_us, end_us) >= MIN_RANGE_COVER * (end_us - start_us):
            function, path, line = GARBAGE_COLLECTOR, "", None
            named_by = "the trace: servprof's ranges around the garbage collector's collections, over most of the stall"
        group = groups.get((function, path))
        if group is None:
            group = groups[(function, path)] = _Group(function, path, line, named_by)
        group.tokenizing |= tokenizing
        for (name, _path), n in functions.items():
            group.functions[name] += n
        shown = biggest.get((function, path))
        if shown and (not group.frames or shown[0] > group.biggest):
            group.biggest = shown[0]
            group.frames, group.innermost = shown[1], shown[2]
        group.stalls.append({"start_us": start_us, "end_us": end_us,
                             "duration_ms": float(stall.get("duration_ms") or 0.0), "in_flight": stall.get("in_flight"),
                             "samples": stall.get("samples", 0), "blocking_request_id": stall.get("blocking_request_id")})
        for rid in stall.get("request_ids") or []:
            if isinstance(rid, str) and rid not in group.request_ids:
                group.request_ids.append(rid)
        rid = stall.get("blocking_request_id")
        if isinstance(rid, str) and rid not in group.blocking_request_ids:
            group.blocking_request_ids.append(rid)

    watched_ms = float((watchdog or {}).get("watched_s") or 0.0) * 1e3
    out: list[Finding] = []
    for group in groups.values():
        finding = _finding(group, watched_ms)
        if not _merge_into_tokenization(finding, findings or []):
            out.append(finding)
    every = [s for g in groups.values() for s in g.stalls]
    summary.update({"groups": len(groups), "stall_ms_total": round(sum(s["duration_ms"] for s in every), 3),
                    "stall_ms_max": round(max((s["duration_ms"] for s in every), default=0.0), 3)})
    return out, summary


def _finding(group: _Group, watched_ms: float) -> Finding:
    stalls = group.stalls
    total = sum(s["duration_ms"] for s in stalls)
    longest = max(s["duration_ms"] for s in stalls)
    where = f"{group.function} ({os.path.basename(group.path)}:{group.line})" if group.path else group.function
    innermost = group.innermost or {}
    inside = ""
    if innermost and (innermost.get("function"), innermost.get("file")) != (group.function, group.path):
        inside = f" in {_where(innermost)}"
    elif innermost and innermost.get("origin") == "library":
        # No frame of the server's own: show who called the library function.
        callers = [f for f in group.frames if f.get("origin") == "library"][-3:-1]
        inside = "".join(f" <- {_where(f)}" for f in reversed(callers))
    others = [name for name, _ in group.functions.most_common(3) if name != group.function]
    also = f" (also seen: {', '.join(others)})" if others else ""
    in_flight = max((s["in_flight"] for s in stalls if isinstance(s["in_flight"], int)), default=None)
    waiting = group.function == WAITING
    severity: Severity = "info"
    # A loop kept from running by other threads, or a stall nothing names, is context, not a cause.
    if not waiting and group.function != UNSAMPLED:
        if longest >= CRITICAL_MS or (watched_ms and total >= 0.25 * watched_ms):
            severity = "critical"
        elif longest >= WARNING_MS:
            severity = "warning"
    kind = "tokenization_stall" if group.tokenizing else KIND
    times = f"{len(stalls)} time{'s' if len(stalls) != 1 else ''}"
    delayed = f", with {in_flight} request(s) in flight" if in_flight else ""
    subject = f"the event loop stalled {times} {WAITING}" if waiting else f"{where} blocked the event loop{inside}{also} {times}"
    title = (f"{subject[0].upper() if waiting else subject[0]}{subject[1:]}, {total:.1f} ms in all (longest {longest:.1f} ms){delayed}"
             + ("; it is tokenization" if kind == "tokenization_stall" else ""))
    frames = group.frames[-MAX_FRAMES_SHOWN:]
    blockers = group.blocking_request_ids
    return Finding(
        kind=kind, severity=severity, cost_ms=total,
        start_us=min(s["start_us"] for s in stalls), end_us=max(s["end_us"] for s in stalls),
        title=title,
        request_ids=[*blockers, *(r for r in group.request_ids if r not in blockers)][:100],
        evidence={"source": "event-loop watchdog", "function": group.function, "file": group.path or None,
                  "line": group.line, "named_by": group.named_by, "functions": {name: round(t, 3) for name, t in group.functions.most_common(8)},
                  "innermost": {k: innermost.get(k) for k in ("function", "file", "line")} if innermost else None,
                  "stalls": len(stalls), "stall_ms_total": round(total, 3), "stall_ms_max": round(longest, 3),
                  "in_flight_max": in_flight, "blocking_request_ids": blockers,
                  "delayed_request_ids": group.request_ids[:100], "frames": frames,
                  "examples": sorted(stalls, key=lambda s: -s["duration_ms"])[:10]},
        fix=_fix(group.function, where, kind, longest, group.frames),
    )


# ssl.py functions that build a context and read the CA store: a client created per request.
_SSL_SETUP = frozenset({"create_default_context", "load_default_certs", "load_verify_locations",
                        "set_default_verify_paths"})


# Blocking waits for another thread's hand-off: (file name, functions), the innermost frames' own.
_THREAD_WAITS = {f"{os.sep}threading.py": {"wait", "join"}, f"{os.sep}queue.py": {"get", "join"},
                 os.path.join("", "concurrent", "futures", "_base.py"): {"result", "wait"}}
_STREAMER_FILE = re.compile(rf"{_SEP}transformers{_SEP}generation{_SEP}streamers\.py$")


def _thread_wait(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The outermost library frame of a blocking wait for another thread that the stack ends in
    (``queue.get`` -> ``Condition.wait``: the ``get``), or None."""
    found = None
    for frame in reversed(frames):
        path = str(frame.get("file"))
        functions = next((names for tail, names in _THREAD_WAITS.items() if path.endswith(tail)), None)
        if not functions or frame.get("function") not in functions:
            break
        found = frame
    return found


def _where(frame: dict[str, Any]) -> str:
    return f"{frame.get('function')} ({os.path.basename(str(frame.get('file')))}:{frame.get('line')})"


def _fix(function: str, where: str, kind: str, longest: float, frames: list[dict[str, Any]]) -> str:
    if any(f.get("function") in _SSL_SETUP and os.path.basename(str(f.get("file"))) == "ssl.py" for f in frames):
        return (f"{where} built an SSL context on the event loop (it loads the CA certificates: milliseconds each "
                "time): create the HTTP client (`httpx.AsyncClient`, `aiohttp.ClientSession`, an SDK's client) once, "
                "at startup or in the app's lifespan, and reuse it for every request instead of opening one per call.")
    waited = _thread_wait(frames)
    if waited is not None and function not in (WAITING, UNSAMPLED):
        streamer = any(_STREAMER_FILE.search(str(f.get("file"))) for f in frames)
        return (f"{where} waits on the event loop for another thread ({_where(waited)}): await the hand-off "
                "instead of blocking the loop on it: "
                + ("transformers' `AsyncTextIteratorStreamer` with `async for` (or `await asyncio.to_thread(next, "
                   "streamer, None)` per token) in place of iterating a TextIteratorStreamer; " if streamer else "")
                + "`await asyncio.to_thread(queue.get)` or an `asyncio.Queue` filled with "
                "`loop.call_soon_threadsafe(queue.put_nowait, item)` for a queue of your own, "
                f"`await asyncio.wrap_future(future)` for a concurrent.futures Future; every request in flight "
                f"waits up to {longest:.0f} ms while it blocks.")
    if function == GARBAGE_COLLECTOR:
        return CAUSES["python_gc"][1]
    if function == WAITING:
        return ("Other threads kept the serving loop from running: keep Python-heavy work (per-token bookkeeping, "
                "tokenization in threads) short or in another process, and leave CPU cores for the server.")
    if function == UNSAMPLED:
        return ("Look at the loop thread in the trace at this time (or turn on SERVPROF_WITH_STACK for one "
                "session): a C extension call that holds the GIL belongs in a worker thread "
                "(`await asyncio.to_thread(...)`); if nothing ran there, the machine's CPUs were busy.")
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
                                            ("function", "file", "line", "functions", "stalls", "stall_ms_max",
                                             "frames")}
            return True
    return False
