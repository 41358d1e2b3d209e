"""Helpers for tests/test_faults.py: a real small filesystem, the real demo server as its own
process, and reading a session trace's servprof metadata."""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

_RUNNING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def mount_error(directory: Path) -> str | None:
    """Why a tmpfs cannot be mounted here (not root, no CAP_SYS_ADMIN), or None when it can."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    probe = directory / "mount-probe"
    probe.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True)
    if result.returncode != 0:
        return f"mount -t tmpfs failed: {result.stderr.decode(errors='replace').strip()}"
    subprocess.run(["umount", str(probe)], check=True)
    return None


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (e.g. "2m") mounted at `directory`, unmounted on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path, leave_free: int) -> Path:
    """Write a filler file until only about `leave_free` bytes stay free on its filesystem."""
    filler = directory / "filler.bin"
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with filler.open("wb") as file:
        file.write(b"\0" * max(0, free - leave_free))
    return filler


def free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def trace_metadata(path: Path) -> dict[str, Any]:
    """The `servprof` metadata of a gzipped chrome trace (raises if it is not one)."""
    with gzip.open(path, "rb") as file:
        document = orjson.loads(file.read())
    assert isinstance(document.get("traceEvents"), list) and document["traceEvents"], path
    meta = document["servprof"]
    return orjson.loads(meta) if isinstance(meta, str) else meta


@contextlib.contextmanager
def demo_server_process(out_dir: Path, token: str, *flags: str, **env: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`servprof demo-server --port 0` as its own process; yields (process, base_url, stderr log).

    The port is read from uvicorn's own start-up line, so no port is guessed. The process is
    killed on exit if the test left it running.
    """
    log = out_dir / "server.stderr"
    out_dir.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "SERVPROF_CONTROL_TOKEN": token, "SERVPROF_OUT_DIR": str(out_dir),
               "SERVPROF_TELEMETRY": "0", "KINETO_LOG_LEVEL": "6", **env}
    command = [sys.executable, "-m", "servprof.cli", "demo-server", "--port", "0", "--log-level", "info", *flags]
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environ, cwd=out_dir)
    try:
        deadline = time.monotonic() + 120
        while (match := _RUNNING.search(log.read_bytes())) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"demo server did not start (exit {process.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield process, f"http://127.0.0.1:{int(match.group(1))}", log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
