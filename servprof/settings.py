"""One Settings object for servprof, read from SERVPROF_* environment variables.

`ServprofMiddleware()` with no arguments (as vLLM adds it) reads everything from the
environment; keyword arguments override single fields. OpenTelemetry's own OTEL_*
variables are left to the OpenTelemetry SDK and read by servprof.telemetry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "SERVPROF_"


class SettingsError(ValueError):
    """A setting has a value servprof cannot use; the message names the variable."""


def _default_service_name() -> str:
    """OpenTelemetry's order: OTEL_SERVICE_NAME, then service.name in OTEL_RESOURCE_ATTRIBUTES (read
    with the SDK's own detector, which decodes it), else servprof's own name."""
    name = os.environ.get("OTEL_SERVICE_NAME")
    if name:
        return name
    if "service.name" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        try:
            from opentelemetry.sdk.resources import OTELResourceDetector

            detected = OTELResourceDetector().detect().attributes.get("service.name")
        except Exception:  # noqa: BLE001 - no SDK, or attributes it cannot read: servprof's name
            detected = None
        if isinstance(detected, str) and detected:
            return detected
    return "servprof"


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    out_dir: Path = Path("servprof-out")

    # Sampling policies (combinable). 0 turns a policy off.
    sample_every: int = 0  # every k-th request
    sample_rate: float = 0.0  # probability per request
    control_token: str | None = None  # enables /servprof/* and the x-servprof-sample header
    control_prefix: str = "/servprof"
    max_on_demand: int = 64  # largest n accepted by POST /servprof/sample
    # Which requests every/rate/on-demand sampling counts (servprof.sampling.RouteFilter): comma-separated
    # globs on the path. Empty sample_routes: any method but GET/HEAD/OPTIONS. The header policy ignores both.
    sample_routes: str = ""
    skip_routes: str = "/health*,/healthz*,/ready*,/readyz*,/live*,/livez*,/ping*,/metrics*,/favicon.ico"
    on_demand_min_interval_s: float = 1.0  # rate limit on POST /servprof/sample

    # Session bounds: a session ends at whichever comes first. stop() and export hold the GIL
    # ~3-7 us per captured event and export ~2-4 us, so max_session_events is what bounds the serving
    # loop's stall (2000 events: ~10-15 ms on 2 CPU cores; see bench/bench_sampling_lag.py).
    requests_per_session: int = 4
    max_session_s: float = 10.0
    max_session_events: int = 2_000  # at ~6 us of stop() each; estimated live (servprof.budget)
    max_session_steps: int = 32  # decode steps, estimated as streamed chunks of the sampled requests
    # Event rate assumed, where no model step can be counted, until a session has measured this
    # server's (the demo makes ~60-75k/s on 2 cores); set high so that a first session errs short.
    assumed_events_per_s: float = 100_000.0
    # Capture tiers (servprof.tiers, docs/middleware.md "Light sessions"): a light session records
    # annotations (servprof's phases, automatic steps and tokenizer calls, the engine's ranges) and
    # device activity, so it can run many steps; a deep window records every op for a few steps.
    # tier "deep" makes every session deep (bounded by max_session_steps and the event budget).
    tier: str = "light"
    light_max_steps: int = 256  # decode steps a light session runs at most
    deep_steps: int = 2  # decode steps of a deep window
    deep_every: int = 4  # a deep window after every k light sessions (0: only on demand, ?tier=deep)
    record_shapes: bool = False
    with_stack: bool = False
    warmup: bool = True  # warm Kineto up in the background at start-up
    # Memory (docs/memory-and-compile.md). profile_memory asks the profiler for allocator events:
    # torch 2.13 records none under profile_all_threads, which servprof needs to see engine
    # threads, so it is off by default; memory_samples are servprof's own allocator/RSS
    # readings on the capture thread (a few us each, at most every 10 ms of a session).
    profile_memory: bool = False
    memory_samples: bool = True
    # Near-OOM snapshots (CUDA only): bounded memory history, a snapshot pickle when reserved
    # memory passes the threshold (a share of the device) or on POST /servprof/memory-snapshot.
    memory_snapshot: bool = False
    memory_snapshot_max_entries: int = 100_000
    memory_snapshot_threshold: float = 0.9
    memory_snapshot_interval_s: float = 60.0  # at most one snapshot per this many seconds
    memory_snapshot_max_files: int = 4
    # Zero-touch phases while a session runs (servprof.auto): model steps, tokenizer calls.
    auto_instrument: bool = True
    loop_stall_ms: float = 10.0  # the serving loop not ticking this long is a stall (0: no watchdog)

    # Trace store retention (oldest files go first).
    trace_max_files: int = 20
    trace_max_mb: float = 200.0

    analysis: bool = True
    analysis_timeout_s: float = 60.0

    telemetry: bool = True
    service_name: str = field(default_factory=_default_service_name)
    capture_content: bool = False  # never put prompt/completion text anywhere unless set
    body_head_bytes: int = 4096

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from SERVPROF_<FIELD> variables, then keyword overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, raw, f.type)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SettingsError(f"unknown servprof setting(s): {', '.join(sorted(unknown))}")
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        checks = [
            (self.sample_every >= 0, "sample_every must be >= 0"),
            (0.0 <= self.sample_rate <= 1.0, "sample_rate must be between 0 and 1"),
            (self.requests_per_session >= 1, "requests_per_session must be >= 1"),
            (self.max_session_s > 0, "max_session_s must be > 0"),
            (self.max_session_events > 0, "max_session_events must be > 0"),
            (self.max_session_steps > 0, "max_session_steps must be > 0"),
            (self.tier in ("light", "deep"), f"tier must be 'light' or 'deep', got {self.tier!r}"),
            (self.light_max_steps > 0, "light_max_steps must be > 0"),
            (self.deep_steps > 0, "deep_steps must be > 0"),
            (self.deep_every >= 0, "deep_every must be >= 0"),
            (self.assumed_events_per_s >= 0, "assumed_events_per_s must be >= 0"),
            (self.loop_stall_ms >= 0, "loop_stall_ms must be >= 0"),
            (self.max_on_demand >= 1, "max_on_demand must be >= 1"),
            (self.trace_max_files >= 1, "trace_max_files must be >= 1"),
            (self.trace_max_mb > 0, "trace_max_mb must be > 0"),
            (self.analysis_timeout_s > 0, "analysis_timeout_s must be > 0"),
            (1 <= self.memory_snapshot_max_entries <= 10_000_000, "memory_snapshot_max_entries must be 1..10000000"),
            (0.0 < self.memory_snapshot_threshold <= 1.0, "memory_snapshot_threshold must be in (0, 1]"),
            (self.memory_snapshot_interval_s >= 0, "memory_snapshot_interval_s must be >= 0"),
            (self.memory_snapshot_max_files >= 1, "memory_snapshot_max_files must be >= 1"),
            (self.control_prefix.startswith("/") and not self.control_prefix.endswith("/"),
             "control_prefix must start with '/' and not end with '/'"),
        ]
        for name in ("sample_routes", "skip_routes"):
            for pattern in getattr(self, name).split(","):
                pattern = pattern.strip()
                if pattern and not pattern.startswith(("/", "*")):
                    checks.append((False, f"{name}: {pattern!r} is not a path glob (start it with '/' or '*')"))
        for ok, message in checks:
            if not ok:
                raise SettingsError(f"servprof: {message} (set through {ENV_PREFIX}<NAME> or keyword)")

    def public_dict(self) -> dict[str, Any]:
        """Settings as shown in /servprof/status: the token is never shown."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["out_dir"] = str(self.out_dir)
        data["control_token"] = "set" if self.control_token else None
        return data


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(name: str, raw: str, type_name: Any) -> Any:
    return parse_env_value(ENV_PREFIX + name.upper(), raw, type_name)


def parse_env_value(var: str, raw: str, type_name: Any) -> Any:
    """An environment variable's text as the dataclass field type named by `type_name`
    (bool, int, float, Path, else str); SettingsError names the variable when it is not."""
    type_text = str(type_name)
    try:
        if type_text == "bool":
            lowered = raw.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(raw)
        if type_text == "int":
            return int(raw)
        if type_text == "float":
            return float(raw)
        if type_text == "Path":
            return Path(raw)
    except ValueError:
        raise SettingsError(f"{var}={raw!r} is not a valid {type_text}") from None
    return raw
