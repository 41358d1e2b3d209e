"""Find the trace files vLLM's workers wrote for one servprof session.

vLLM's workers write `<prefix>_dp0_pp0_tp0_dcp0_ep0_rank0.<time_ns>.pt.trace.json.gz`
(one per rank) into `--profiler-config.torch_profiler_dir`, and the API process may
write a CPU-only `<host>_<pid>.async_llm...` trace and `*.profiler_out.txt` tables.
servprof gives each session its own prefix, so its files are the ones starting with
it. A file counts as complete when its size has stopped changing and, for gzip, its
trailer is there (a worker may still be writing when stop_profile returns).
"""

from __future__ import annotations

import gzip
import re
import time
import zlib
from pathlib import Path

from servprof.store import linked_prefix

TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json")
RANK_PATTERN = re.compile(r"rank(\d+)")
POLL_S = 0.2


def session_prefix(session_id: str) -> str:
    """vLLM accepts prefixes of letters, digits, '-' and '_'; session ids are made by servprof
    (of those characters only), so this is the store's linked prefix, which retention sweeps."""
    return linked_prefix(re.sub(r"[^A-Za-z0-9_-]", "_", session_id))


def _candidates(directory: Path, prefix: str) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.name.startswith(prefix + "_") and p.name.endswith(TRACE_SUFFIXES))


def _gzip_complete(path: Path) -> bool:
    """True when the gzip stream ends properly (a file still being written does not)."""
    try:
        with gzip.open(path, "rb") as stream:
            while stream.read(1 << 20):
                pass
        return True
    except (EOFError, OSError, zlib.error):
        return False


def rank_of(path: Path) -> int | None:
    match = RANK_PATTERN.search(path.name)
    return int(match.group(1)) if match else None


def wait_for_session_traces(directory: Path, prefix: str, expected_ranks: int | None,
                            timeout_s: float) -> tuple[list[Path], str | None]:
    """The session's complete trace files, waiting up to `timeout_s` for every rank.

    Returns the files and, when not all came, why (the files that did come are kept).
    """
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, int] = {}
    complete: set[Path] = set()
    while True:
        for path in _candidates(directory, prefix):
            if path in complete:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            settled = sizes.get(path) == size and size > 0
            sizes[path] = size
            if settled and (not path.name.endswith(".gz") or _gzip_complete(path)):
                complete.add(path)
        ranks = {rank_of(p) for p in complete}
        enough = len(ranks) >= expected_ranks if expected_ranks else bool(complete) and len(complete) == len(sizes)
        if enough:
            return sorted(complete), None
        if time.monotonic() >= deadline:
            if not complete:
                return [], f"no complete vLLM trace with prefix {prefix!r} in {directory} after {timeout_s:.0f} s"
            return sorted(complete), (f"only {len(ranks)} of {expected_ranks} ranks wrote a complete trace "
                                      f"within {timeout_s:.0f} s")
        time.sleep(POLL_S)
