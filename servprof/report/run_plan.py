"""What one `servprof analyze PATH` analyses: which files are one run (the ranks of one job),
and which are successive windows of one process, each analysed on its own.

- a file: one run;
- a directory of per-rank files (HTA's ``rank-0...``, one file per worker): one run;
- servprof's session traces (each with its .session.json / .analysis.json beside it): one run
  each, oldest first;
- torch.profiler's ``tensorboard_trace_handler`` output, ``<worker>.<time_ns>.pt.trace.json[.gz]``:
  a worker with several files recorded several profiler cycles (successive windows, not ranks):
  window k is each worker's k-th file, its workers the ranks.

A directory's files are only known to be one job once they are read: files that claim the same
rank, say different world sizes or ran on different devices are not one job's ranks (a folder of
downloaded traces, one worker's windows renamed), and are then analysed one by one (apart_reason).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from servprof.detect.devices import device_name, match_device_properties, trace_device_properties
from servprof.trace.loader import SIDECAR_SUFFIXES, trace_files
from servprof.trace.meta import claimed_world_size, file_name, files_by_claimed_rank
from servprof.trace.model import distinct

if TYPE_CHECKING:
    from servprof.detect.analysis import Analysis
    from servprof.trace import Trace

# torch.profiler.tensorboard_trace_handler names each file f"{worker_name}.{time.time_ns()}.pt.trace.json"
# (".gz" with use_gzip); the worker name defaults to f"{hostname}_{pid}" and may hold dots.
HANDLER_FILE = re.compile(r"^(?P<worker>.+)\.(?P<stamp>\d+)\.pt\.trace\.json(?:\.gz)?$")


@dataclass
class Run:
    """One analysis: a trace file, or one run's per-rank files."""

    label: str
    path: Path
    files: list[Path] | None = None  # the files to load (None: all that ``path`` names)
    analysis: Analysis | None = None
    trace: Trace | None = None
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    runs: list[Run]
    files: list[Path]  # every trace file the path names
    kind: str = "run"  # "run" | "session" (servprof sessions) | "window" (profiler cycles)


def servprof_sessions_dir(path: Path) -> Path:
    """servprof's output folder (servprof-out/) keeps its session traces in traces/: read those."""
    traces = path / "traces"
    if path.is_dir() and traces.is_dir() and not any(f.name.endswith(".pt.trace.json.gz") for f in path.iterdir()):
        return traces
    return path


def plan_runs(path: Path) -> Plan:
    files = trace_files(path)
    if not path.is_dir() or len(files) < 2:
        return Plan([Run(files[0].name if path.is_dir() else str(path), path if not path.is_dir() else files[0])],
                    files)
    sessions = [f for f in files if any((f.parent / f"{session_stem(f)}{sidecar}").exists()
                                        for sidecar in SIDECAR_SUFFIXES)]
    if sessions:
        ordered = sorted(files, key=lambda f: (f.stat().st_mtime_ns, f.name))
        return Plan([Run(session_stem(f), f) for f in ordered], files, "session")
    windows = _handler_windows(files)
    if windows:
        # (A one-worker window is read as that file, and named so in its report.)
        return Plan([Run(label, group[0] if len(group) == 1 else path, group) for label, group in windows], files,
                    "window")
    return Plan([Run(str(path), path)], files)


def apart_reason(trace: Trace) -> str | None:
    """Why the files a directory's trace was loaded from are not one job's ranks, or None. One job's
    ranks each claim their own rank, agree on the world size, and ran on one kind of device (a rank
    judged against another rank's device would get another peak bandwidth)."""
    claims = files_by_claimed_rank(trace.metadata)
    sizes: dict[int, list[str]] = {}
    devices: dict[frozenset[str], list[str]] = {}
    for rank, document in sorted(trace.metadata.items()):
        name = file_name(rank, document)
        size = claimed_world_size(document)
        if size is not None:
            sizes.setdefault(size, []).append(name)
        kinds = frozenset(match_device_properties(p) or device_name(p) or "" for p in
                          trace_device_properties({rank: document})) - {""}
        if kinds:
            devices.setdefault(kinds, []).append(name)
    shared = next(((r, files) for r, files in sorted(claims.items()) if len(files) > 1), None)
    if shared is not None:
        return f"{_listed(shared[1])} all claim rank {shared[0]}"
    if len(sizes) > 1:
        return "they name different world sizes (" + "; ".join(
            f"{size}: {_listed(files)}" for size, files in sorted(sizes.items())) + ")"
    if len(devices) > 1:
        return "they ran on different devices (" + "; ".join(
            f"{', '.join(sorted(kinds))}: {_listed(files)}" for kinds, files in devices.items()) + ")"
    return None


def host_only_files(trace: Trace) -> list[str]:
    """The files of a directory's trace that recorded no device work beside files that did: not ranks
    of the job but another process's trace (vLLM's API server writes a CPU-only ``<host>_<pid>.async_llm``
    one beside its workers'), analysed on its own. Empty when every file, or none, ran on a device."""
    with_device = set(distinct(trace.rank[trace.device_mask()]).tolist())
    if not with_device:
        return []
    return [file_name(rank, document) for rank, document in sorted(trace.metadata.items()) if rank not in with_device]


def host_only_reason(files: list[str]) -> str:
    return (f"{_listed(files)} recorded no device work beside ranks that did: another process's trace (a server's "
            "frontend, as vLLM's API server's async_llm one), not a rank")


def _listed(files: list[str], shown: int = 3) -> str:
    return ", ".join(files[:shown]) + (f" and {len(files) - shown} more" if len(files) > shown else "")


def session_records(path: Path) -> list[dict[str, Any]] | None:
    """The request records of a servprof session trace, from its .session.json beside it (what
    the live analysis had: request arrival and first byte, for the findings that need them), or
    None (not a session's trace, or the file unreadable: the trace is analysed without them)."""
    sidecar = path.parent / f"{session_stem(path)}.session.json"
    try:
        records = orjson.loads(sidecar.read_bytes()).get("requests")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else None


def session_stem(path: Path) -> str:
    name = path.name
    for suffix in (".pt.trace.json.gz", ".pt.trace.json", ".json.gz", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _handler_windows(files: list[Path]) -> list[tuple[str, list[Path]]]:
    """tensorboard_trace_handler's files as windows (label, files), when some worker wrote several;
    else nothing."""
    by_worker: dict[str, list[tuple[int, Path]]] = {}
    for f in files:
        match = HANDLER_FILE.match(f.name)
        if match is None:
            return []
        by_worker.setdefault(match["worker"], []).append((int(match["stamp"]), f))
    if max(len(mine) for mine in by_worker.values()) < 2:
        return []
    for mine in by_worker.values():
        mine.sort()
    cycles = max(len(mine) for mine in by_worker.values())
    windows = []
    for k in range(cycles):
        group = [mine[k][1] for _, mine in sorted(by_worker.items()) if k < len(mine)]
        windows.append((f"window {k + 1} ({session_stem(group[0])})", group))
    return windows
