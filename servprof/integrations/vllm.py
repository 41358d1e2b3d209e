"""servprof inside `vllm serve`: ``--middleware servprof.integrations.vllm.VLLMMiddleware``.

vLLM runs the model in EngineCore and worker processes, so a torch.profiler started in
the API process (where a middleware lives) sees no model work. For sampled requests
this middleware therefore drives **vLLM's own profiler** through the engine client
(`start_profile(profile_prefix=..., max_iterations=...)` / `stop_profile()`), waits
for every rank's trace file, runs servprof's detectors on them in a child process,
and ties the steps and findings to the sampled requests by time window. In the API
process it measures what the worker traces cannot show: tokenization on vLLM's
one-thread pool and event-loop lag (servprof.integrations.vllm_probes).

Everything else — settings (SERVPROF_* env vars, since vLLM passes no kwargs),
sampling, /servprof/status and /servprof/sample, spans — is ServprofMiddleware's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from servprof.analysis import empty_result
from servprof.capture import DONE, FAILED, SHUTDOWN_FLUSH_S, STARTING, CaptureController, Session
from servprof.integrations.vllm_probes import ApiProbes, api_findings
from servprof.integrations.vllm_traces import session_prefix, wait_for_session_traces
from servprof.middleware import ServprofMiddleware
from servprof.settings import Settings
from servprof.tiers import DEEP

logger = logging.getLogger("servprof.vllm")

RPC_TIMEOUT_S = 60.0  # start_profile / stop_profile on the engine
TRACE_WAIT_S = 60.0  # for every rank's trace file after stop_profile
ENGINE_SHUTDOWN_WAIT_S = 30.0  # the longest vLLM's engine shutdown waits for servprof's session to stop
LINKED_KIND = "vllm"  # <session>.vllm: the store's folder of links to the session's rank files
NOT_CONFIGURED = ("vLLM was started without --profiler-config, so its workers cannot be profiled; start it with "
                  "--profiler-config.profiler torch --profiler-config.torch_profiler_dir DIR")
ALREADY_ACTIVE = "vLLM's profiler is already running (someone called /start_profile); servprof skipped this sample"


class VLLMCaptureController(CaptureController):
    """Capture through vLLM's engine-side profiler instead of an in-process torch.profiler.

    Runs on servprof's capture thread like its parent; the engine client's coroutines
    are scheduled on the server's event loop and awaited from that thread, so the
    loop itself never waits on profiling. Sampled requests do not wait for the start
    either: vLLM's workers pick the profiler up at their next step.
    """

    wait_for_start = False

    def __init__(self) -> None:
        super().__init__()
        self.warm = True  # nothing to warm up in this process
        self.app_state: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.not_configured: str | None = None
        self.probe_summary: dict[str, Any] | None = None
        self._probes: ApiProbes | None = None
        self._prefix: str | None = None

    # --- binding to the vLLM app (first request) --------------------------------------------------

    def bind(self, app_state: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.app_state = app_state
        self.loop = loop
        config = self.profiler_config()
        if config is None or getattr(config, "profiler", None) is None:
            self.not_configured = NOT_CONFIGURED
            logger.warning("servprof: %s", NOT_CONFIGURED)
        self._stop_before_engine_shutdown(getattr(app_state, "engine_client", None))

    def _stop_before_engine_shutdown(self, engine: Any) -> None:
        """On SIGTERM vLLM shuts its engine down first (`engine_client.shutdown`, from a worker
        thread) and runs the HTTP server's lifespan shutdown only after: too late to stop vLLM's
        profiler and collect the rank files. So the engine's shutdown first stops servprof's session
        (trace files kept, analysis skipped) and flushes spans, bounded in time."""
        original = getattr(engine, "shutdown", None)
        if original is None or getattr(original, "_servprof_wrapped", False):
            return
        controller = self

        def shutdown(*args: Any, **kwargs: Any) -> Any:
            controller.stop_for_engine_shutdown()
            return original(*args, **kwargs)

        shutdown._servprof_wrapped = True  # type: ignore[attr-defined]
        try:
            engine.shutdown = shutdown
        except (AttributeError, TypeError):  # an engine client that takes no attributes: lifespan only
            logger.info("servprof: cannot hook vLLM's engine shutdown; a session running at shutdown may be lost")

    def stop_for_engine_shutdown(self) -> None:
        on_loop = False
        with contextlib.suppress(RuntimeError):
            on_loop = asyncio.get_running_loop() is self.loop
        if on_loop:
            # Called on the event loop (vLLM's engine context exiting): stop_profile needs this loop,
            # so waiting here would only time out. The first, threaded call has done the work.
            return
        self.stop_now("vLLM engine shutdown", ENGINE_SHUTDOWN_WAIT_S, SHUTDOWN_FLUSH_S)

    def profiler_config(self) -> Any:
        vllm_config = getattr(self.app_state, "vllm_config", None)
        config = getattr(vllm_config, "profiler_config", None)
        if config is None:
            config = getattr(getattr(self.app_state, "args", None), "profiler_config", None)
        return config

    def trace_dir(self) -> Path | None:
        directory = getattr(self.profiler_config(), "torch_profiler_dir", "") or ""
        return Path(directory) if directory else None

    def expected_ranks(self) -> int | None:
        parallel = getattr(getattr(self.app_state, "vllm_config", None), "parallel_config", None)
        size = getattr(parallel, "world_size", None)
        return int(size) if isinstance(size, int) and size > 0 else None

    def extra_status(self) -> dict[str, Any]:
        return {"vllm": {"bound": self.app_state is not None, "not_configured": self.not_configured,
                         "trace_dir": str(self.trace_dir()) if self.app_state is not None else None},
                "last_api_process": self.probe_summary}

    # --- the parent's hooks -----------------------------------------------------------------------

    def refusal(self) -> tuple[str, str] | None:
        if self.not_configured:
            return "not_configured", self.not_configured
        if self.app_state is None:
            return "not_bound", "servprof has not seen vLLM's app state yet"
        return super().refusal()

    def _warm_up(self) -> None:
        self.warm = True

    def tier_for(self, settings: Settings, asked: str | None = None) -> tuple[str, int]:
        # vLLM's workers run their own torch profiler, configured by vLLM's --profiler-config:
        # what they record is theirs to choose; servprof bounds the steps.
        return DEEP, settings.max_session_steps

    def estimated_events(self, elapsed_s: float, steps: int, assumed_per_s: float = 0.0) -> float:
        # The events are captured in vLLM's workers, not here: the session's bound on them is
        # max_iterations (= max_session_steps), which vLLM enforces itself.
        return 0.0

    def admit(self, record: Any, settings: Settings, store: Any, reason: str, target_requests: int,
              on_finished: Any, tier: str | None = None) -> Session | None:
        session = super().admit(record, settings, store, reason, target_requests, on_finished, tier)
        # Called on the event loop: the API-side probes go in before this request is
        # tokenized, while the engine's profiler is still being started.
        if session is not None and self._probes is None and session.state == STARTING:
            renderer = getattr(getattr(self.app_state, "engine_client", None), "renderer", None)
            if renderer is not None:
                self._probes = ApiProbes(renderer)
                self._probes.start()
        return session

    def _end(self, session: Session, state: str) -> None:
        probes, self._probes = self._probes, None
        if probes is not None and self.loop is not None:  # a session that failed before _finish
            asyncio.run_coroutine_threadsafe(probes.stop(), self.loop)
        super()._end(session, state)

    def _on_loop(self, coroutine: Any, timeout_s: float = RPC_TIMEOUT_S) -> Any:
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError only from 3.11 on
            future.cancel()  # a late start_profile must not leave vLLM's profiler on
            raise

    def _start(self, session: Session) -> None:
        problem = session.store.check_writable()
        if problem:
            self._fail(session, problem, store_problem=True)
            return
        engine = getattr(self.app_state, "engine_client", None)
        if engine is None:
            self._fail(session, "vLLM's app state has no engine_client")
            return
        session.tier_note = "recorded by vLLM's workers, as vLLM's profiler_config asks"
        self._prefix = session_prefix(session.session_id)
        directory = self.trace_dir()
        if directory is not None:
            session.store.linked_dirs.add(directory)  # retention sweeps the session's files there
        session.wall_start_ns = time.time_ns()
        session.perf_start_ns = session.last_poll_ns = time.perf_counter_ns()  # busy time counts from here
        try:
            self._on_loop(engine.start_profile(profile_prefix=self._prefix,
                                               max_iterations=session.settings.max_session_steps))
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raises, serving goes on
            self._fail(session, ALREADY_ACTIVE if type(exc).__name__ == "ProfilerAlreadyActiveError"
                       else f"vLLM start_profile failed: {type(exc).__name__}: {exc}")
            return
        session.timed("start", session.perf_start_ns)
        self.sessions_started += 1
        self._begin_capture(session)

    def _finish(self, session: Session, why: str) -> None:
        self._begin_stop(session, why)
        engine = self.app_state.engine_client
        stop_error = None
        session.capture_end_ns = time.perf_counter_ns()
        try:
            self._on_loop(engine.stop_profile())
        except Exception as exc:  # noqa: BLE001
            stop_error = f"vLLM stop_profile failed: {type(exc).__name__}: {exc}"
        session.perf_end_ns = time.perf_counter_ns()
        session.timed("stop", session.capture_end_ns)
        probes, self._probes = self._probes, None
        summary: dict[str, Any] = {}
        if probes is not None:
            try:
                self._on_loop(probes.stop(), 10.0)
                summary = probes.summary({record.request_id for record in session.records})
            except Exception as exc:  # noqa: BLE001
                summary = {"problems": [f"API probes failed: {exc}"]}
        self.probe_summary = summary
        directory = self.trace_dir()
        waited = time.perf_counter_ns()
        files, missing = ([], "vLLM's profiler has no torch_profiler_dir") if directory is None else \
            wait_for_session_traces(directory, self._prefix or "", self.expected_ranks(), TRACE_WAIT_S)
        session.timed("export", waited)  # vLLM's workers writing their trace files
        result = self._analyse(session, files)
        result["api_process"] = summary
        # Findings and phases are in trace µs (unix ns = µs * 1000 + offset); the API-side
        # findings are measured in unix time, so they are brought into the same frame.
        clock = result.setdefault("clock", {})
        offset_ns = clock.setdefault("trace_us_to_unix_ns_offset", 0)
        api = api_findings(summary)
        for finding in api:
            finding["start_us"] -= offset_ns / 1e3
            finding["end_us"] -= offset_ns / 1e3
        result["findings"] = _tie_to_requests(result.get("findings", []) + api, session, offset_ns)
        problems = [p for p in (stop_error, missing) if p]
        if problems:
            result.setdefault("summary", {})["problems"] = problems
        if not files:
            result["error"] = result.get("error") or "; ".join(problems) or "no vLLM trace files"
        session.result = result
        session.error = result.get("error")
        self._end(session, FAILED if session.error else DONE)

    def _analyse(self, session: Session, files: list[Path]) -> dict[str, Any]:
        # The rank files stay where vLLM wrote them; the store gets a folder of links to them,
        # which the trace loader reads as one multi-rank trace, and which retention counts and
        # removes with the files (an empty one still owns rank files that come too late).
        try:
            folder = session.store.link_session(session.session_id, files, LINKED_KIND)
        except OSError as exc:
            return empty_result(session.session_id, None, error=f"could not link vLLM's trace files: {exc}")
        if not files:
            return empty_result(session.session_id, None)
        session.trace_path = folder
        result = session.analyse(folder)
        result.setdefault("summary", {})["rank_files"] = [str(p) for p in files]
        return result


def _tie_to_requests(findings: list[dict[str, Any]], session: Session, offset_ns: int) -> list[dict[str, Any]]:
    """Worker traces know no HTTP requests: a finding belongs to the sampled requests
    that were in flight during its time range."""
    offset_us = offset_ns / 1e3
    session_end = session.perf_end_ns or time.perf_counter_ns()
    windows = []
    for record in session.records:
        # A request still streaming when the session ended is in flight until then.
        end_perf = record.end_ns or session_end
        start_us = record.arrival_ns / 1e3 - offset_us
        windows.append((record.request_id, start_us, start_us + (end_perf - record.arrival_perf_ns) / 1e3))
    for finding in findings:
        if finding.get("request_ids"):
            continue
        start, end = finding.get("start_us"), finding.get("end_us")
        if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
            continue
        finding["request_ids"] = [rid for rid, lo, hi in windows if start <= hi and end >= lo]
    return findings


class VLLMMiddleware(ServprofMiddleware):
    """For ``vllm serve --middleware servprof.integrations.vllm.VLLMMiddleware`` (no kwargs:
    settings come from SERVPROF_* environment variables)."""

    def __init__(self, app: ASGIApp, settings: Settings | None = None, **overrides: Any) -> None:
        super().__init__(app, settings, controller=VLLMCaptureController(), **overrides)
        self._bound = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._bound and scope["type"] == "http":
            app = scope.get("app")
            state = getattr(app, "state", None)
            if state is not None and getattr(state, "engine_client", None) is not None:
                self.runtime.controller.bind(state, asyncio.get_running_loop())
                self._bound = True
        await super().__call__(scope, receive, send)
