"""Sampled requests the app refused: a session can show no model work of theirs, and says why.

A request the app answers with a client error (4xx: no or a wrong API key, an invalid body, an
unknown route, a rate limit) was refused before any model work. Without this entry, a session whose
sampled requests were all refused said only what every trace without steps says (mark your steps,
record stacks), which sends the user after markers the server does not need.
"""

from __future__ import annotations

from typing import Any

REFUSED_WHAT = "sampled requests refused"
MAX_ROUTES_NAMED = 3


def refused_missing(requests: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The ``summary["missing"]`` entry for the session's sampled requests the app refused (none when
    it refused none). ``requests``: the session's request records (status, route, path)."""
    records = [r for r in requests or [] if isinstance(r, dict)]
    refused = [r for r in records if _refused(r.get("status"))]
    if not refused:
        return []
    codes: dict[int, int] = {}
    for record in refused:
        codes[record["status"]] = codes.get(record["status"], 0) + 1
    answered = (str(next(iter(codes))) if len(codes) == 1
                else ", ".join(f"{code} ({count})" for code, count in sorted(codes.items())))
    routes = sorted({str(r.get("route") or r.get("path") or "?") for r in refused})
    named = ", ".join(routes[:MAX_ROUTES_NAMED]) + (f" and {len(routes) - MAX_ROUTES_NAMED} more"
                                                    if len(routes) > MAX_ROUTES_NAMED else "")
    if len(refused) == len(records):
        what_then = ("so this session shows no model work of theirs: no model step and no tokenization here is a "
                     "finding about the server. Check what the client sends (the API key the app expects, a valid "
                     "body, the route), then sample again")
    else:
        what_then = (f"so only the other {len(records) - len(refused)} sampled request(s) show model work in this "
                     "session")
    return [{"what": REFUSED_WHAT,
             "message": f"{len(refused)} of the {len(records)} sampled request(s) were answered {answered} by the "
                        f"app ({named}): a client error, a refusal before any model work (no or a wrong API key, an "
                        f"invalid body, an unknown route, a rate limit). servprof gave their places in the session to "
                        f"other requests while it captured (status: counters.refused), {what_then}."}]


def _refused(status: Any) -> bool:
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500
