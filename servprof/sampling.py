"""Which requests to sample: combinable policies, decided in O(1) per request.

Policies (any one is enough):

* ``header``: the request carries ``x-servprof-sample: 1`` *and* the control token,
  either as ``x-servprof-token: <token>`` or ``Authorization: Bearer <token>``
  (the separate header exists because an OpenAI-style API already uses Authorization
  for its own keys). Without a configured token the header is ignored.
* ``on_demand``: ``POST /servprof/sample?n=N`` asks for the next N requests.
* ``every``: every k-th request (``sample_every``).
* ``rate``: each request with probability ``sample_rate``.

The sampler only says "this request is a candidate"; the capture controller may still
refuse it (a session is busy, a foreign profiler runs, the trace dir is unwritable).
An on-demand candidate that was refused is given back so the order is not lost.

Sampling spends sessions on requests that do model work: ``every``, ``rate`` and
``on_demand`` count only requests the route filter lets through (by default any method but
GET/HEAD/OPTIONS, never health checks or metrics scrapes; ``sample_routes`` /
``skip_routes`` change that). The header is an explicit request from someone holding the
token and is honoured on any route.
"""

from __future__ import annotations

import fnmatch
import hmac
import os
import random
import re
import threading
from typing import Any

from servprof.settings import Settings

REASON_HEADER = "header"
REASON_ON_DEMAND = "on_demand"
REASON_EVERY = "every"
REASON_RATE = "rate"


_NON_MODEL_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))


def route_patterns(text: str) -> list[str]:
    """Comma-separated path globs (``*`` also matches ``/``), blanks dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _compile(patterns: list[str]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)) if patterns else None


class RouteFilter:
    """Which requests count for every/rate/on-demand sampling: one regex match per request."""

    __slots__ = ("_sample", "_skip")

    def __init__(self, sample_routes: str, skip_routes: str):
        self._sample = _compile(route_patterns(sample_routes))
        self._skip = _compile(route_patterns(skip_routes))

    def eligible(self, method: str, path: str, full_path: str | None = None) -> bool:
        """``path``: the path the app routes on; ``full_path``: the whole path when it differs (a
        root path before it), which globs written with the root path in them match."""
        other = None if full_path is None or full_path is path or full_path == path else full_path
        skip, sample = self._skip, self._sample
        if skip is not None and (skip.match(path) or (other is not None and skip.match(other))):
            return False
        if sample is not None:
            return sample.match(path) is not None or (other is not None and sample.match(other) is not None)
        return method not in _NON_MODEL_METHODS


def route_path(scope: dict[str, Any]) -> str:
    """The path the app routes on: ``path`` without ``root_path``, the prefix a proxy strips
    (``uvicorn --root-path /api``, ``FastAPI(root_path=...)``), which ASGI servers put in
    ``path``. Sampling globs and servprof's own endpoints match it, as the app's routes do."""
    path: str = scope["path"]
    root = scope.get("root_path")
    if root and path.startswith(root):
        if len(path) == len(root):
            return "/"
        if path[len(root)] == "/":
            return path[len(root):]
    return path


# servprof's own generator, for the rate policy's draws and the middleware's request ids (never the
# app's global `random`, which an app may seed). Re-seeded (from urandom) in each forked worker: workers
# that a pre-fork server forked after building the middleware (gunicorn --preload) would otherwise all
# draw the same sequence, give the same ids and sample their n-th requests together.
SERVPROF_RANDOM = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SERVPROF_RANDOM.seed)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Sampler:
    __slots__ = ("_every", "_rate", "_token", "_random", "_seen", "_on_demand", "order_id", "_order_lock",
                 "counts", "_routes", "_eligible", "_not_eligible")

    def __init__(self, settings: Settings, rng: random.Random | None = None):
        self._every = settings.sample_every
        self._rate = settings.sample_rate
        self._token = settings.control_token.encode() if settings.control_token else None
        self._random = (rng or SERVPROF_RANDOM).random
        self._seen = 0
        self._eligible = 0  # requests the route filter let through (every k-th counts these)
        self._not_eligible = 0
        self._routes = RouteFilter(settings.sample_routes, settings.skip_routes)
        self._on_demand = 0  # requests still owed to the last on-demand order
        self.order_id = 0  # which order that is: a session ending cancels only its own
        # The capture thread cancels orders while the serving loop counts them down.
        self._order_lock = threading.Lock()
        self.counts = {REASON_HEADER: 0, REASON_ON_DEMAND: 0, REASON_EVERY: 0, REASON_RATE: 0,
                       "header_rejected": 0}

    @property
    def on_demand_pending(self) -> int:
        return self._on_demand

    def order(self, n: int) -> None:
        """Sample the next ``n`` requests (replaces a previous, unfinished order)."""
        with self._order_lock:
            self._on_demand = n
            self.order_id += 1

    def cancel_order(self, order_id: int | None = None) -> int:
        """Drop what is left of the order (of order ``order_id`` only, when given: a newer
        order placed while its session was still exporting stays)."""
        with self._order_lock:
            if order_id is not None and order_id != self.order_id:
                return 0
            left, self._on_demand = self._on_demand, 0
            return left

    def give_back(self, reason: str) -> None:
        """A candidate was refused by capture; an on-demand slot stays owed to the next request."""
        if reason == REASON_ON_DEMAND:
            with self._order_lock:
                self._on_demand += 1
            self.counts[REASON_ON_DEMAND] -= 1

    def token_matches(self, presented: bytes | None) -> bool:
        return self._token is not None and presented is not None and hmac.compare_digest(presented, self._token)

    def decide(self, header_asked: bool = False, presented_token: bytes | None = None,
               method: str = "POST", path: str = "/", full_path: str | None = None) -> str | None:
        """The reason to sample this request, or None. Counts every call as one request. (``path``
        and ``full_path``: RouteFilter.eligible.)"""
        self._seen += 1
        if header_asked:
            if self.token_matches(presented_token):
                self.counts[REASON_HEADER] += 1
                return REASON_HEADER
            self.counts["header_rejected"] += 1
        if not (self._every or self._rate or self._on_demand):
            return None  # no policy could pick it: the route filter costs nothing then
        if not self._routes.eligible(method, path, full_path):
            self._not_eligible += 1
            return None
        self._eligible += 1
        if self._on_demand > 0:  # the lock only on this rare path
            with self._order_lock:
                taken = self._on_demand > 0
                if taken:
                    self._on_demand -= 1
            if taken:
                self.counts[REASON_ON_DEMAND] += 1
                return REASON_ON_DEMAND
        if self._every and self._eligible % self._every == 0:
            self.counts[REASON_EVERY] += 1
            return REASON_EVERY
        if self._rate and self._random() < self._rate:
            self.counts[REASON_RATE] += 1
            return REASON_RATE
        return None

    def status(self) -> dict[str, object]:
        return {"requests_seen": self._seen, "eligible": self._eligible, "not_eligible": self._not_eligible,
                "on_demand_pending": self._on_demand, "candidates": dict(self.counts)}
