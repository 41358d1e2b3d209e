"""POST /servprof/memory-snapshot and the snapshot keeper, on a CPU machine.

The endpoint is real (uvicorn, the middleware, the token check). A CUDA snapshot cannot be
taken here: on CPU the endpoint must say so (409); the rate limit, the files written and
their retention are checked with a stand-in for ``torch.cuda.memory._snapshot()`` (a dict of
the same shape, empty), which is the only part replaced. The written pickle is opened with
torch's own ``_memory_viz``, the command servprof tells users to run.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _middleware_helpers import AUTH, TOKEN, tiny_server

from servprof.probes.snapshot import SNAPSHOT_SUFFIX, MemorySnapshots, SnapshotUnavailable
from servprof.settings import Settings, SettingsError

URL = "/servprof/memory-snapshot"


def _empty_snapshot() -> dict:
    # What torch.cuda.memory._snapshot() returns with no device memory in use.
    return {"segments": [], "device_traces": [[]]}


def _stand_in_keeper(settings: Settings, traces_dir: Path) -> MemorySnapshots:
    return MemorySnapshots(settings, traces_dir, take_snapshot=_empty_snapshot, needs_cuda=False)


def test_on_cpu_the_endpoint_says_cuda_is_needed_after_auth_and_validation(tmp_path: Path):
    with tiny_server(tmp_path, control_token=TOKEN, memory_snapshot=True) as (url, mw, _e), \
            httpx.Client(timeout=10) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-servprof-token": TOKEN}):
            assert client.post(url + URL, headers=headers).status_code == 401
        assert client.get(url + URL, headers=AUTH).status_code == 405
        assert client.post(url + URL + "?max_entries=5", headers=AUTH).status_code == 400
        answer = client.post(url + URL, headers=AUTH)
        assert answer.status_code == 409
        assert "CUDA" in answer.json()["error"]
        assert answer.json()["memory_snapshots"]["cuda"] is False
        status = client.get(url + "/servprof/status", headers=AUTH).json()["memory_snapshots"]
    assert status["enabled"] is True and status["recording"] is False and status["files"] == []
    assert "CUDA" in status["unavailable"]
    assert not list((tmp_path / "out" / "traces").glob(f"*{SNAPSHOT_SUFFIX}"))


def test_off_by_default_and_says_how_to_turn_it_on(tmp_path: Path):
    with tiny_server(tmp_path, control_token=TOKEN) as (url, _mw, _e), httpx.Client(timeout=10) as client:
        answer = client.post(url + URL, headers=AUTH)
    assert answer.status_code == 409 and "SERVPROF_MEMORY_SNAPSHOT=1" in answer.json()["error"]


def test_rate_limit_files_and_how_to_open_them(tmp_path: Path):
    with tiny_server(tmp_path, control_token=TOKEN, memory_snapshot=True, memory_snapshot_interval_s=30) \
            as (url, mw, _e), httpx.Client(timeout=10) as client:
        mw.runtime.memory_snapshots = _stand_in_keeper(mw.runtime.settings, mw.runtime.store.traces_dir)
        taken = client.post(url + URL, headers=AUTH)
        assert taken.status_code == 201, taken.text
        body = taken.json()
        limited = client.post(url + URL, headers=AUTH)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    path = Path(body["file"])
    assert path.parent == tmp_path / "out" / "traces" and path.name.endswith(SNAPSHOT_SUFFIX)
    assert path.stat().st_mode & 0o777 == 0o600
    assert pickle.loads(path.read_bytes()) == _empty_snapshot()
    assert "memory_viz" in body["open_with"] and str(path) in body["open_with"]
    # The command servprof prints opens the file (torch's own viewer, no GPU needed).
    html = tmp_path / "snapshot.html"
    subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(html)],
                   check=True, capture_output=True, timeout=120)
    assert html.stat().st_size > 0


def test_retention_keeps_the_newest_within_count_and_bytes(tmp_path: Path):
    settings = Settings(memory_snapshot=True, memory_snapshot_interval_s=0, memory_snapshot_max_files=3)
    keeper = _stand_in_keeper(settings, tmp_path)
    files = [keeper.take("test")["file"] for _ in range(5)]
    kept = [str(p) for p in keeper.snapshots()]
    assert kept == files[-3:]
    # The trace store's byte budget counts too: a 1 MiB budget keeps only the newest 600 KiB one.
    big = MemorySnapshots(Settings(memory_snapshot=True, memory_snapshot_interval_s=0, trace_max_mb=1),
                          tmp_path / "big", take_snapshot=lambda: {"blob": b"x" * 600 * 1024}, needs_cuda=False)
    first, second = big.take("a")["file"], big.take("b")["file"]
    assert [str(p) for p in big.snapshots()] == [second] and not Path(first).exists()


def test_without_cuda_the_keeper_refuses_with_a_reason(tmp_path: Path):
    keeper = MemorySnapshots(Settings(memory_snapshot=True), tmp_path)
    with pytest.raises(SnapshotUnavailable, match="CUDA"):
        keeper.take("test")
    keeper.start_watching()  # no watcher without CUDA: nothing to watch
    assert keeper.status()["recording"] is False


@pytest.mark.parametrize(("name", "value"), [
    ("MEMORY_SNAPSHOT_MAX_ENTRIES", "0"), ("MEMORY_SNAPSHOT_MAX_ENTRIES", "100000000"),
    ("MEMORY_SNAPSHOT_THRESHOLD", "0"), ("MEMORY_SNAPSHOT_THRESHOLD", "1.5"),
    ("MEMORY_SNAPSHOT_INTERVAL_S", "-1"), ("MEMORY_SNAPSHOT_MAX_FILES", "0"), ("MEMORY_SNAPSHOT", "maybe"),
])
def test_snapshot_settings_are_bounded(name: str, value: str):
    with pytest.raises(SettingsError):
        Settings.from_env({f"SERVPROF_{name}": value})
