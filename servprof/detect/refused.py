"""Sampled requests the app refused or failed: a session can show no (or little) model work of
theirs, and says why before anything else.

A request the app answers with a client error (4xx: no or a wrong API key, an invalid body, an
unknown route, a rate limit) was refused before any model work; one answered with a server error
(5xx) failed, possibly before its first step, as did one the app raised on: the server (or
Starlette's ServerErrorMiddleware) below servprof answered it, so its record has no status but
names the exception. Without these entries, a session
whose sampled requests were all refused said only what every trace without steps says (mark your
steps, record stacks), which sends the user after markers the server does not need.
"""

from __future__ import annotations

from typing import Any

REFUSED_WHAT = "sampled requests refused"
FAILED_WHAT = "sampled requests failed"
MAX_ROUTES_NAMED = 3


def refused_missing(requests: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The ``summary["missing"]`` entries for the session's sampled requests the app refused, and
    for a session whose sampled requests all failed (none otherwise). ``requests``: the session's
    request records (status, route, path)."""
    records = [r for r in requests or [] if isinstance(r, dict)]
    refused = [r for r in records if _status_in(r, 400, 500)]
    failed = [r for r in records if _status_in(r, 500, 600) or _raised(r)]
    entries = []
    if refused:
        if len(refused) == len(records):
            then = ("so this session shows no model work of theirs, and its lack of model steps and tokenization says "
                    "nothing about the server. Check what the client sends (the API key the app expects, a valid "
                    "body, the route), then sample again")
        else:
            then = f"so only the other {len(records) - len(refused)} sampled request(s) show model work in this session"
        entries.append({"what": REFUSED_WHAT, "message": (
            f"{len(refused)} of the {len(records)} sampled request(s) were answered {_answered(refused)}: a client "
            "error, a refusal before any model work (no or a wrong API key, an invalid body, an unknown route, a "
            "rate limit). servprof gave their places in the session to other requests while it captured (status: "
            f"counters.refused), {then}.")})
    if failed and len(failed) == len(records):
        entries.append({"what": FAILED_WHAT, "message": (
            f"The {len(failed)} sampled request(s) failed: {_failures(failed)}. The session shows the work "
            "they did before failing (no model step, if they failed before one); the error itself is in the "
            "server's log.")})
    return entries


def _answered(records: list[dict[str, Any]]) -> str:
    """"401 by the app (/v1/completions)", "401 (1), 422 (2) by the app (/a, /b and 2 more)"."""
    return f"{_counted([r['status'] for r in records])} by the app ({_routes(records)})"


def _failures(records: list[dict[str, Any]]) -> str:
    """"answered 500 by the app (/a)", "raised RuntimeError (/a)", "answered 503 by the app; raised
    ValueError (/a, /b)"."""
    raised = [r for r in records if _raised(r)]
    answered = [r["status"] for r in records if not _raised(r)]
    how = [*([f"answered {_counted(answered)} by the app"] if answered else []),
           *([f"raised {_counted([r['error'] for r in raised])}"] if raised else [])]
    return f"{'; '.join(how)} ({_routes(records)})"


def _counted(values: list[Any]) -> str:
    """"500" when all are one value, else "500 (1), 503 (2)"."""
    counts: dict[Any, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    if len(counts) == 1:
        return str(next(iter(counts)))
    return ", ".join(f"{value} ({count})" for value, count in sorted(counts.items(), key=lambda item: str(item[0])))


def _routes(records: list[dict[str, Any]]) -> str:
    routes = sorted({str(r.get("route") or r.get("path") or "?") for r in records})
    return ", ".join(routes[:MAX_ROUTES_NAMED]) + (f" and {len(routes) - MAX_ROUTES_NAMED} more"
                                                   if len(routes) > MAX_ROUTES_NAMED else "")


def _raised(record: dict[str, Any]) -> bool:
    """The app raised (no status: the server below servprof answered), not a client that left."""
    return record.get("status") is None and isinstance(record.get("error"), str) and not record.get("disconnected")


def _status_in(record: dict[str, Any], low: int, high: int) -> bool:
    status = record.get("status")
    return isinstance(status, int) and not isinstance(status, bool) and low <= status < high
