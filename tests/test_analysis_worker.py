"""The warm analysis worker (servprof/analysis_worker.py): one process reused from session to
session, replaced when it retires, goes idle, crashes or hangs; a second analysis at once gets a
one-shot worker; a forked process never touches its parent's worker. Real worker processes
(``python -m servprof.analysis --serve``) on a real profiler trace; the stand-ins below replace
the worker only where a real one cannot be made to misbehave, and say so."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import record_phase_trace

from servprof import analysis, analysis_worker
from servprof.analysis_worker import WORKERS


@pytest.fixture(scope="module")
def session_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real capture with servprof phases, and its session description."""
    folder = tmp_path_factory.mktemp("worker")
    trace = record_phase_trace(folder, "w1")
    session = folder / "w1.session.json"
    session.write_bytes(orjson.dumps({"session_id": "w1", "requests": [{"request_id": "r1"}]}))
    return trace, session


@pytest.fixture(autouse=True)
def fresh_workers() -> None:
    analysis.kill_running_analyses()
    yield
    analysis.kill_running_analyses()


def analyse(files: tuple[Path, Path], tmp_path: Path, name: str = "w1.analysis.json") -> dict:
    trace, session = files
    return analysis.run_analysis("w1", trace, session, tmp_path / name, timeout_s=60)


def warm_pid() -> int | None:
    warm = WORKERS._warm
    return warm.process.pid if warm is not None and warm.alive() else None


def test_one_worker_serves_session_after_session(session_files: tuple[Path, Path], tmp_path: Path) -> None:
    first = analyse(session_files, tmp_path)
    pid = warm_pid()
    second = analyse(session_files, tmp_path, "again.json")
    assert first["error"] is None and second["error"] is None, (first["error"], second["error"])
    assert [p["name"] for p in second["requests"]["r1"]["phases"]] == ["tokenize", "decode_step"]
    assert pid is not None and warm_pid() == pid and WORKERS._warm.jobs == 2
    assert len(WORKERS.running) == 1
    # Low priority, and one thread for its numeric libraries (it must not spin on torch's cores).
    assert os.getpriority(os.PRIO_PROCESS, pid) >= analysis_worker.CHILD_NICENESS
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"OPENBLAS_NUM_THREADS=1" in environ and b"OMP_NUM_THREADS=1" in environ


def test_prestart_imports_before_the_first_job(session_files: tuple[Path, Path], tmp_path: Path) -> None:
    WORKERS.prestart()
    pid = warm_pid()
    assert pid is not None
    assert analyse(session_files, tmp_path)["error"] is None and warm_pid() == pid


def test_the_serving_process_settings_reach_a_warm_worker(session_files: tuple[Path, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker started before a setting changed reads it as a fresh child would."""
    assert analyse(session_files, tmp_path)["error"] is None
    monkeypatch.setenv("SERVPROF_MAX_TRACE_BYTES", "100")
    refused = analyse(session_files, tmp_path)
    assert "TraceError" in refused["error"] and "100" in refused["error"], refused["error"]
    monkeypatch.delenv("SERVPROF_MAX_TRACE_BYTES")
    assert analyse(session_files, tmp_path)["error"] is None


def test_a_retired_worker_is_replaced(session_files: tuple[Path, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(analysis_worker, "ONE_JOB_PER_WORKER", True)
    assert analyse(session_files, tmp_path)["error"] is None
    assert warm_pid() is None and not WORKERS.running  # it said it retires: let go of at once
    assert analyse(session_files, tmp_path)["error"] is None


def test_output_of_the_analysis_itself_never_corrupts_a_reply(session_files: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A print, in Python or from C, during a job goes to the worker's stderr, not into its replies."""
    noisy = ("import os, sys\n"
             "from servprof import analysis\n"
             "real = analysis.analyse\n"
             "def noisy(*args):\n"
             "    print('a library talking on stdout')\n"
             "    os.write(1, b'and C code too\\n')\n"
             "    return real(*args)\n"
             "analysis.analyse = noisy\n"
             "sys.exit(analysis.main(['--serve']))\n")
    monkeypatch.setattr(analysis_worker, "worker_command", lambda: [sys.executable, "-c", noisy])
    for name in ("a.json", "b.json"):
        result = analyse(session_files, tmp_path, name)
        assert result["error"] is None and "r1" in result["requests"], result["error"]
    assert WORKERS._warm is not None and WORKERS._warm.jobs == 2


def test_a_worker_gone_idle_as_the_job_came_is_replaced_without_an_error(
        session_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in: a worker that answers its first job, then exits 0 without answering the second, as
    # a real one does when IDLE_EXIT_S runs out just as a job arrives (a race a test cannot time).
    idle_then_gone = ("import json, sys\n"
                      "job = json.loads(sys.stdin.readline())\n"
                      "open(job['result'], 'w').write(json.dumps({'session_id': 'w1', 'error': None, 'requests': {}, 'findings': []}))\n"
                      "print(json.dumps({'ok': True, 'error': None, 'retire': False}), flush=True)\n"
                      "sys.stdin.readline()\n")
    real_command = analysis_worker.worker_command
    commands = iter([[sys.executable, "-c", idle_then_gone]])
    monkeypatch.setattr(analysis_worker, "worker_command", lambda: next(commands, None) or real_command())
    assert analyse(session_files, tmp_path)["error"] is None
    result = analyse(session_files, tmp_path)
    assert result["error"] is None and "r1" in result["requests"]  # from the real worker, started for it


def test_a_worker_that_hangs_is_killed_and_the_next_job_gets_a_new_one(
        session_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace, session = session_files
    real_command = analysis_worker.worker_command
    commands = iter([[sys.executable, "-c", "import time; time.sleep(600)"]])  # stand-in: a hung worker
    monkeypatch.setattr(analysis_worker, "worker_command", lambda: next(commands, None) or real_command())
    hung = analysis.run_analysis("w1", trace, session, tmp_path / "h.json", timeout_s=1)
    assert hung["error"] == "analysis timed out after 1 s and was killed"
    assert not WORKERS.running
    assert analyse(session_files, tmp_path)["error"] is None


def test_a_shutdown_kills_a_worker_mid_job_and_the_analysis_returns_at_once(
        session_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill_running_analyses() from another thread (the shutdown path) while the capture thread
    waits for the reply: the wait ends with the kill, not at the 60 s timeout."""
    trace, session = session_files
    monkeypatch.setattr(analysis_worker, "worker_command",  # stand-in: a worker that never answers
                        lambda: [sys.executable, "-c", "import time; time.sleep(600)"])
    results: list[dict] = []
    waiting = threading.Thread(target=lambda: results.append(
        analysis.run_analysis("w1", trace, session, tmp_path / "k.json", timeout_s=60)))
    waiting.start()
    deadline = time.monotonic() + 30
    while not any(worker.jobs and worker.alive() for worker in list(WORKERS.running)):  # the job is sent
        assert time.monotonic() < deadline and waiting.is_alive()
        time.sleep(0.01)
    analysis.kill_running_analyses()
    waiting.join(30)
    assert not waiting.is_alive() and results[0]["error"] == "analysis process exited with status -9: "
    assert not WORKERS.running


def test_a_second_analysis_at_once_gets_a_one_shot_worker(session_files: tuple[Path, Path], tmp_path: Path) -> None:
    assert analyse(session_files, tmp_path)["error"] is None
    pid = warm_pid()
    assert WORKERS._lock.acquire(blocking=False)  # the warm worker busy with another session's job
    try:
        assert analyse(session_files, tmp_path, "other.json")["error"] is None
        assert WORKERS.running == {WORKERS._warm}  # the one-shot worker is gone
    finally:
        WORKERS._lock.release()
    assert warm_pid() == pid and WORKERS._warm.jobs == 1


def test_a_forked_process_lets_its_parents_worker_be(session_files: tuple[Path, Path], tmp_path: Path) -> None:
    assert analyse(session_files, tmp_path)["error"] is None
    pid = warm_pid()
    child = os.fork()
    if child == 0:  # the fork: no worker of its own yet, and the parent's left alone
        os._exit(0 if not WORKERS.running and WORKERS._warm is None else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert warm_pid() == pid and analyse(session_files, tmp_path)["error"] is None and WORKERS._warm.jobs == 2


def serve_in_process(lines: list[bytes], **kwargs: float) -> tuple[int, list[dict]]:
    """analysis.serve() on real pipes, its replies read back (in this process, whose memory is not
    a worker's: it retires on memory only when a test asks)."""
    kwargs.setdefault("retire_bytes", 2**62)
    jobs_read, jobs_write = os.pipe()
    replies_read, replies_write = os.pipe()
    with os.fdopen(jobs_write, "wb") as jobs:
        jobs.write(b"".join(lines))
    with os.fdopen(jobs_read, "rb") as jobs, os.fdopen(replies_write, "wb") as replies:
        status = analysis.serve(jobs, replies, **kwargs)
    with os.fdopen(replies_read, "rb") as replies:
        return status, [orjson.loads(line) for line in replies.read().splitlines()]


def test_serve_answers_each_job_and_a_bad_one_clearly(session_files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, session = session_files
    good = orjson.dumps({"trace": str(trace), "session": str(session), "result": str(tmp_path / "r.json")}) + b"\n"
    missing = orjson.dumps({"trace": str(tmp_path / "none.json.gz"), "session": str(session),
                            "result": str(tmp_path / "n.json")}) + b"\n"
    environ = dict(os.environ)
    status, replies = serve_in_process([good, b"not json\n", missing, good])
    assert dict(os.environ) == environ  # each job's settings applied for it alone
    assert status == 0 and [r["ok"] for r in replies] == [True, False, False, True]
    assert replies[1]["error"] == "servprof analysis: a job it cannot read (JSONDecodeError)"
    assert replies[2]["error"].startswith("servprof analysis failed: TraceError")
    assert orjson.loads((tmp_path / "r.json").read_bytes())["session_id"] == "w1"
    assert oct((tmp_path / "r.json").stat().st_mode & 0o777) == "0o600"


def test_serve_retires_after_its_last_job_and_leaves_when_idle(session_files: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    trace, session = session_files
    job = orjson.dumps({"trace": str(trace), "session": str(session), "result": str(tmp_path / "r.json")}) + b"\n"
    status, replies = serve_in_process([job, job, job], max_jobs=2)
    assert status == 0 and [r["retire"] for r in replies] == [False, True]  # the third is never read
    retire = orjson.dumps({"trace": str(trace), "session": str(session), "result": str(tmp_path / "r.json"),
                           "retire": True}) + b"\n"
    assert [r["retire"] for r in serve_in_process([retire, job])[1]] == [True]
    assert [r["retire"] for r in serve_in_process([job, job], retire_bytes=1)[1]] == [True]  # holds too much
    jobs_read, jobs_write = os.pipe()  # nothing ever written, the pipe kept open: it leaves when idle
    with os.fdopen(jobs_read, "rb") as jobs, open(os.devnull, "wb") as replies:
        assert analysis.serve(jobs, replies, idle_exit_s=0.05) == 0
    os.close(jobs_write)
