"""Sampling policies' counts over many requests, and the trace store's retention."""

from __future__ import annotations

import math
import os
import random
import stat
import threading
import time
from pathlib import Path

import orjson
import pytest

from servprof.sampling import REASON_ON_DEMAND, RouteFilter, Sampler, route_path
from servprof.settings import Settings, SettingsError
from servprof.store import TRACE_SUFFIX, StoreError, TraceStore, linked_prefix

TOKEN = "s3cret"


def _count(sampler: Sampler, n: int, **kwargs: object) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for _ in range(n):
        reason = sampler.decide(**kwargs)  # type: ignore[arg-type]
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def test_no_policy_samples_nothing() -> None:
    assert _count(Sampler(Settings()), 5000) == {None: 5000}


@pytest.mark.parametrize("k", [1, 3, 7, 100])
def test_every_kth_request(k: int) -> None:
    sampler = Sampler(Settings(sample_every=k))
    reasons = [sampler.decide() for _ in range(1000)]
    picked = [i + 1 for i, r in enumerate(reasons) if r == "every"]
    assert len(picked) == 1000 // k
    assert all(i % k == 0 for i in picked)


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.5])
def test_rate_is_within_binomial_bounds(rate: float) -> None:
    n = 20000
    sampler = Sampler(Settings(sample_rate=rate), rng=random.Random(1234))
    hits = _count(sampler, n).get("rate", 0)
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(hits - n * rate) < 5 * sigma


def test_header_needs_the_configured_token() -> None:
    sampler = Sampler(Settings(control_token=TOKEN))
    assert sampler.decide(header_asked=True, presented_token=TOKEN.encode()) == "header"
    assert sampler.decide(header_asked=True, presented_token=b"wrong") is None
    assert sampler.decide(header_asked=True, presented_token=None) is None
    assert sampler.decide(header_asked=False, presented_token=TOKEN.encode()) is None
    assert sampler.counts["header"] == 1 and sampler.counts["header_rejected"] == 2
    # Without a configured token the header is never honoured, whatever is presented.
    untokened = Sampler(Settings())
    assert untokened.decide(header_asked=True, presented_token=b"") is None
    assert untokened.decide(header_asked=True, presented_token=b"anything") is None


def test_on_demand_samples_exactly_the_next_n() -> None:
    sampler = Sampler(Settings())
    sampler.order(5)
    assert _count(sampler, 100) == {"on_demand": 5, None: 95}
    sampler.order(3)
    sampler.order(2)  # a new order replaces the unfinished one
    assert _count(sampler, 10) == {"on_demand": 2, None: 8}


def test_refused_on_demand_candidate_stays_owed() -> None:
    sampler = Sampler(Settings())
    sampler.order(2)
    assert sampler.decide() == "on_demand"
    sampler.give_back("on_demand")  # capture was busy
    assert [sampler.decide() for _ in range(3)] == ["on_demand", "on_demand", None]
    assert sampler.counts["on_demand"] == 2


def test_policies_combine() -> None:
    sampler = Sampler(Settings(sample_every=10, sample_rate=0.05, control_token=TOKEN), rng=random.Random(7))
    sampler.order(4)
    counts = _count(sampler, 2000)
    assert counts["on_demand"] == 4
    # every-k counts every request seen, on-demand ones included
    assert counts["every"] == 2000 // 10 - sum(1 for i in range(1, 5) if i % 10 == 0)
    rate_candidates = 2000 - 4 - counts["every"]
    assert abs(counts["rate"] - 0.05 * rate_candidates) < 5 * math.sqrt(rate_candidates * 0.05 * 0.95)
    assert sampler.decide(header_asked=True, presented_token=TOKEN.encode()) == "header"
    assert sum(counts.values()) == 2000 and sampler.status()["requests_seen"] == 2001


def _fake_trace(store: TraceStore, name: str, size: int, age_s: float) -> Path:
    path = store.traces_dir / f"{name}{TRACE_SUFFIX}"
    path.write_bytes(b"x" * size)
    (store.traces_dir / f"{name}.session.json").write_bytes(b"{}")
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_routes_without_model_work_are_not_counted() -> None:
    sampler = Sampler(Settings(sample_every=2))
    requests = [("GET", "/health"), ("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/v1/models"),
                ("POST", "/v1/completions"), ("HEAD", "/"), ("POST", "/healthz"), ("POST", "/v1/chat/completions")]
    reasons = [sampler.decide(False, None, method, path) for method, path in requests]
    # Only the three POSTs to model routes count: the 2nd of them is the every-2nd request.
    assert reasons == [None, None, None, None, "every", None, None, None]
    assert sampler.status()["eligible"] == 3 and sampler.status()["not_eligible"] == 5


def test_route_settings_choose_what_counts() -> None:
    routes = RouteFilter(sample_routes="/generate*, /v1/*", skip_routes="/v1/models")
    assert routes.eligible("GET", "/generate?x")  # sample_routes replaces the method rule
    assert routes.eligible("POST", "/v1/completions") and routes.eligible("GET", "/v1/embeddings/x")
    assert not routes.eligible("POST", "/v1/models") and not routes.eligible("POST", "/other")
    default = RouteFilter("", Settings().skip_routes)
    assert not default.eligible("POST", "/health/live") and not default.eligible("GET", "/anything")
    assert default.eligible("PUT", "/jobs/3")
    with pytest.raises(SettingsError, match="skip_routes: 'health' is not a path glob"):
        Settings.from_env({"SERVPROF_SKIP_ROUTES": "/metrics,health"})


def test_on_demand_orders_skip_health_checks_and_the_header_is_honoured_anywhere() -> None:
    sampler = Sampler(Settings(control_token=TOKEN))
    sampler.order(2)
    assert sampler.decide(False, None, "GET", "/health") is None  # a probe does not eat the order
    assert sampler.decide(False, None, "POST", "/v1/completions") == REASON_ON_DEMAND
    assert sampler.on_demand_pending == 1
    # An explicit per-request ask with the token is honoured on any route.
    assert sampler.decide(True, TOKEN.encode(), "GET", "/health") == "header"


def test_retention_removes_oldest_first_by_count_and_size(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, max_files=3, max_mb=1.0)
    assert store.check_writable() is None
    paths = [_fake_trace(store, f"s{i}", 100_000, age_s=100 - i) for i in range(5)]
    removed = store.enforce_retention()
    assert removed == paths[:2]
    assert store.traces() == paths[2:]
    assert not (store.traces_dir / "s0.session.json").exists() and (store.traces_dir / "s4.session.json").exists()
    big = _fake_trace(store, "s9", 900_000, age_s=0)
    assert store.enforce_retention(keep=big) == paths[2:4]
    assert store.traces() == [paths[4], big]


def test_linked_sessions_count_their_files_and_go_with_them(tmp_path: Path) -> None:
    """A vLLM session is a <session>.vllm folder of links to rank files written elsewhere: its size
    is theirs, and retention removes them, with the session's other prefixed files there (vLLM's
    tables), never a file without the session's prefix that a link points to."""
    store = TraceStore(tmp_path / "out", max_files=10, max_mb=100.0)
    assert store.check_writable() is None
    elsewhere = tmp_path / "vllm-profiles"
    elsewhere.mkdir()
    foreign = elsewhere / "operator_rank0.pt.trace.json.gz"
    foreign.write_bytes(b"y" * 10)
    folders = []
    for i, age in enumerate((30, 20)):
        sid = f"s{i}"
        ranks = [elsewhere / f"{linked_prefix(sid)}_rank{r}.1.pt.trace.json.gz" for r in range(2)]
        for rank in ranks:
            rank.write_bytes(b"x" * 400_000)
        (elsewhere / f"{linked_prefix(sid)}_rank0.profiler_out.txt").write_bytes(b"table")
        folder = store.link_session(sid, ranks, "vllm")
        os.symlink(foreign, folder / foreign.name)  # not the session's: never deleted
        stamp = time.time() - age
        os.utime(folder, (stamp, stamp))
        folders.append(folder)
    # Two sessions of 800 kB each: over 1 MiB, so the older goes, rank files and table included.
    store.max_bytes = 1024 * 1024
    assert store.enforce_retention(keep=folders[1]) == [folders[0]]
    assert store.traces() == [folders[1]]
    left = sorted(p.name for p in elsewhere.iterdir())
    assert left == sorted([foreign.name, *(f"{linked_prefix('s1')}_rank{r}.1.pt.trace.json.gz" for r in range(2)),
                           f"{linked_prefix('s1')}_rank0.profiler_out.txt"])
    # Counted by file number too: a trace file and a linked folder are one session each.
    _fake_trace(store, "s2", 10, age_s=0)
    store.max_files = 1
    assert store.enforce_retention() == [folders[1]]
    assert not any(p.name.startswith(linked_prefix("s1")) for p in elsewhere.iterdir())


def test_store_names_come_from_session_ids_only(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, max_files=3, max_mb=1.0)
    with pytest.raises(ValueError):
        store.path_for("../../etc/passwd")
    store.check_writable()
    path = store.write_json("abc-123", ".session.json", {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_session_file_rewritten_while_read_is_always_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture thread rewrites .session.json while status tools (and the tests) read it: a
    reader sees the last whole file, never an empty or half-written one, and a failed rewrite
    keeps the last whole one."""
    store = TraceStore(tmp_path, max_files=3, max_mb=1.0)
    store.check_writable()
    records = [{"request_id": f"r{i}", "route": "/v1/completions", "chunks": i} for i in range(20_000)]
    path = store.write_json("s1", ".session.json", {"version": 0, "requests": records})
    stop = threading.Event()

    def rewrite() -> None:
        version = 0
        while not stop.is_set():
            version += 1
            store.write_json("s1", ".session.json", {"version": version, "requests": records})

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        versions = [orjson.loads(path.read_bytes())["version"] for _ in range(300)]
    finally:
        stop.set()
        writer.join()
    assert versions == sorted(versions) and versions[-1] > 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not list(store.traces_dir.glob("*.tmp"))

    def disk_full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(StoreError, match="No space left"):
        store.write_json("s1", ".session.json", {"version": -1})
    assert orjson.loads(path.read_bytes())["requests"] == records and not list(store.traces_dir.glob("*.tmp"))


def test_unwritable_store_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "not writable" in (TraceStore(blocker, 3, 1.0).check_writable() or "")
    assert "MiB free" in (TraceStore(tmp_path, 3, 1.0, min_free_mb=1e12).check_writable() or "")


def test_a_session_ending_cancels_only_its_own_order() -> None:
    """An order placed while the previous on-demand session still exports or analyses is kept
    when that session ends (it was answered 202; dropping it would be silent)."""
    sampler = Sampler(Settings(control_token=TOKEN))
    sampler.order(1)
    first = sampler.order_id
    assert sampler.decide() == REASON_ON_DEMAND and sampler.on_demand_pending == 0
    sampler.order(2)  # while the first order's session is still finishing
    assert sampler.cancel_order(first) == 0 and sampler.on_demand_pending == 2
    assert [sampler.decide() for _ in range(2)] == [REASON_ON_DEMAND] * 2
    sampler.order(3)
    assert sampler.cancel_order(sampler.order_id) == 3 and sampler.on_demand_pending == 0


def test_session_files_that_cannot_be_written_are_a_store_problem(tmp_path: Path) -> None:
    """Like the trace itself: the capture thread pauses sampling on it, not a generic error."""
    blocker = tmp_path / "out"
    blocker.write_text("a file where the output dir should be")
    with pytest.raises(StoreError, match="could not write"):
        TraceStore(blocker, 3, 1.0).write_json("s1", ".session.json", {"session_id": "s1"})


def test_retention_ignores_a_trace_removed_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers sharing one output dir delete each other's oldest traces."""
    store = TraceStore(tmp_path, max_files=1, max_mb=1.0)
    store.traces_dir.mkdir(parents=True)
    for name in ("a", "b"):
        (store.traces_dir / f"{name}{TRACE_SUFFIX}").write_bytes(b"x")
    listed = store.traces()
    (store.traces_dir / f"a{TRACE_SUFFIX}").unlink()  # another worker's retention
    monkeypatch.setattr(store, "traces", lambda: listed)
    assert store.enforce_retention() == [store.traces_dir / f"a{TRACE_SUFFIX}"]


@pytest.mark.parametrize(("path", "root_path", "routed"), [
    ("/v1/chat", "", "/v1/chat"),
    ("/api/v1/chat", "/api", "/v1/chat"),
    ("/api", "/api", "/"),
    ("/apiv1/chat", "/api", "/apiv1/chat"),  # a prefix of a segment is not the root
    ("/v1/chat", "/api", "/v1/chat"),  # a server that leaves the root out of path
])
def test_routes_match_the_path_without_the_root_path(path: str, root_path: str, routed: str) -> None:
    assert route_path({"path": path, "root_path": root_path}) == routed


def test_globs_match_the_routed_path_or_the_whole_one() -> None:
    """Behind a root path, globs match the path the app routes on; globs written with the root path in
    them (as they had to be before) match the whole path still."""
    routes = RouteFilter(sample_routes="/v1/*,/api/v2/*", skip_routes="/api/v1/models")
    assert routes.eligible("POST", "/v1/chat", "/api/v1/chat")
    assert routes.eligible("POST", "/v2/chat", "/api/v2/chat")
    assert not routes.eligible("GET", "/v1/models", "/api/v1/models")
    assert not routes.eligible("POST", "/v3/chat", "/api/v3/chat")
    assert routes.eligible("POST", "/v1/chat") and not routes.eligible("POST", "/v2/chat")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_workers_draw_their_own_rate_decisions() -> None:
    """A pre-fork server that built the middleware before forking (gunicorn --preload): each worker's
    rate policy draws its own sequence, so the workers do not sample their n-th requests together."""
    sampler = Sampler(Settings(sample_rate=0.5))
    sampler.decide()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: its next decisions, to the parent
        try:
            os.write(write, bytes(int(sampler.decide() is not None) for _ in range(64)))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read()
    os.waitpid(child, 0)
    mine = bytes(int(sampler.decide() is not None) for _ in range(64))
    assert len(theirs) == len(mine) == 64
    assert theirs != mine  # (the same 64 draws by chance: 2^-64)
