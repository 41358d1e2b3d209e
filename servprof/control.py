"""Control endpoints, served by the middleware itself under ``settings.control_prefix``.

    GET  /servprof/status        settings, counters, sessions, last findings, why paused
    POST /servprof/sample?n=N    sample the next N requests (one session); &tier=deep for a deep window
    POST /servprof/memory-snapshot   a CUDA memory snapshot into the trace dir (servprof.probes.snapshot)

Off unless a control token is configured (SERVPROF_CONTROL_TOKEN): without one these
paths go to the app like any other. Every call needs ``Authorization: Bearer <token>``
(compared in constant time); errors are JSON ``{"error": "..."}``.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import parse_qs

import anyio.to_thread
import orjson
from starlette.types import Receive, Scope, Send

from servprof.probes.snapshot import SnapshotTooSoon, SnapshotUnavailable
from servprof.runtime import ServprofRuntime
from servprof.sampling import Sampler, bearer_token
from servprof.tiers import TIERS

_JSON_HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]


async def respond(send: Send, status: int, body: Any, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS, default=str)
    headers = _JSON_HEADERS + [(b"content-length", str(len(payload)).encode())] + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def authorized(scope: Scope, sampler: Sampler) -> bool:
    """The request's bearer token is the control token (compared in constant time)."""
    authorization = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), None)
    return sampler.token_matches(bearer_token(authorization))


def parse_order(query_string: bytes, max_n: int) -> tuple[int | None, str | None, str | None]:
    """(n, tier, None) or (None, None, error message) for the sample endpoint's query: ``n``
    requests (default 1), optionally ``tier=light|deep`` (deep: a window of every op, few steps)."""
    try:
        query = parse_qs(query_string.decode("latin-1"), keep_blank_values=True, strict_parsing=False)
    except ValueError:
        return None, None, "query string could not be parsed"
    unknown = set(query) - {"n", "tier"}
    if unknown:
        return None, None, f"unknown parameter(s): {', '.join(sorted(unknown))}; only n and tier are accepted"
    tiers = query.get("tier", [])
    if len(tiers) > 1 or (tiers and tiers[0] not in TIERS):
        return None, None, f"give tier once, as one of: {', '.join(TIERS)}"
    values = query.get("n", ["1"])
    if len(values) != 1:
        return None, None, "give n once"
    raw = values[0].strip()
    if not raw.isdigit() or len(raw) > 6:
        return None, None, f"n must be a whole number from 1 to {max_n}, got {raw[:20]!r}"
    n = int(raw)
    if not 1 <= n <= max_n:
        return None, None, f"n must be from 1 to {max_n} (SERVPROF_MAX_ON_DEMAND), got {n}"
    return n, tiers[0] if tiers else None, None


async def handle(runtime: ServprofRuntime, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
    """Answer one request whose path is under the control prefix (the token is configured);
    ``endpoint``: its path after the prefix ("/status")."""
    settings = runtime.settings
    runtime.counters["control_requests"] += 1
    assert settings.control_token is not None
    if not authorized(scope, runtime.sampler):
        await respond(send, 401, {"error": "missing or wrong bearer token for servprof control"},
                      [(b"www-authenticate", b'Bearer realm="servprof"')])
        return
    method = scope["method"]
    if endpoint == "/status":
        if method != "GET":
            await respond(send, 405, {"error": "use GET for status"}, [(b"allow", b"GET")])
            return
        await respond(send, 200, runtime.status())
        return
    if endpoint == "/sample":
        if method != "POST":
            await respond(send, 405, {"error": "use POST to order samples"}, [(b"allow", b"POST")])
            return
        n, tier, error = parse_order(scope.get("query_string", b""), settings.max_on_demand)
        if error is not None or n is None:
            await respond(send, 400, {"error": error})
            return
        wait = runtime.last_order_at + settings.on_demand_min_interval_s - time.monotonic()
        if runtime.last_order_at and wait > 0:
            await respond(send, 429, {"error": f"one sample order per {settings.on_demand_min_interval_s:g} s; "
                                               f"retry in {wait:.1f} s"},
                          [(b"retry-after", str(max(1, round(wait))).encode())])
            return
        if not settings.enabled:
            await respond(send, 409, {"error": "servprof is disabled (SERVPROF_ENABLED=0)"})
            return
        runtime.order(n, tier)
        await respond(send, 202, {"ordered": n, "tier": tier or runtime.controller.tier_for(settings)[0],
                                  "paused": runtime.why_paused(),
                                  "pid": os.getpid(),
                                  "message": f"the next {n} request(s) this process (pid {os.getpid()}) serves will be "
                                             "sampled in one session"})
        return
    if endpoint == "/memory-snapshot":
        await memory_snapshot(runtime, scope, send)
        return
    await respond(send, 404, {"error": f"no servprof endpoint {scope['path']}; try {settings.control_prefix}/status"})


async def memory_snapshot(runtime: ServprofRuntime, scope: Scope, send: Send) -> None:
    """POST /servprof/memory-snapshot: 201 with the file and how to open it; 409 when no snapshot
    can be taken here (no CUDA, or SERVPROF_MEMORY_SNAPSHOT off); 429 within
    SERVPROF_MEMORY_SNAPSHOT_INTERVAL_S of the last one. Taken on a worker thread."""
    if scope["method"] != "POST":
        await respond(send, 405, {"error": "use POST to take a memory snapshot"}, [(b"allow", b"POST")])
        return
    if scope.get("query_string"):
        await respond(send, 400, {"error": "memory-snapshot takes no parameters"})
        return
    keeper = runtime.memory_snapshots
    problem = keeper.unavailable()
    if problem:
        await respond(send, 409, {"error": problem, "memory_snapshots": keeper.status()})
        return
    try:
        if keeper.wait_s() > 0:
            raise SnapshotTooSoon(keeper.wait_s())
        result = await anyio.to_thread.run_sync(keeper.take, "on demand (POST /servprof/memory-snapshot)")
    except SnapshotTooSoon as exc:
        await respond(send, 429, {"error": f"one memory snapshot per {keeper.settings.memory_snapshot_interval_s:g} s; "
                                           f"{exc}"}, [(b"retry-after", str(max(1, round(exc.wait_s))).encode())])
        return
    except SnapshotUnavailable as exc:
        await respond(send, 409, {"error": str(exc)})
        return
    except OSError as exc:
        await respond(send, 507, {"error": f"the snapshot could not be stored: {exc.strerror or exc}"})
        return
    except Exception as exc:  # noqa: BLE001 - torch failing to snapshot is an answer, not a crash
        await respond(send, 500, {"error": f"the snapshot failed: {type(exc).__name__}: {exc}"})
        return
    await respond(send, 201, result)
