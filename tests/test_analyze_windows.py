"""`servprof analyze DIR` on torch.profiler's own output folder: ``tensorboard_trace_handler``
writes one ``<worker>.<time_ns>.pt.trace.json`` per profiler cycle. Several files of one worker
are successive windows of one process, analysed each on its own, never ranks of one job (which
is what they were read as: "rank 0" and "rank 1" of a single-process run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import public_trace
from _tiny_llm import NEW_TOKENS, generate, tiny_llama
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from servprof.cli import main
from servprof.report.run_plan import plan_runs


def _touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(public_trace("hta_cuda_event_sync_a100.json.gz"), folder / name)
    return folder


def test_each_workers_cycles_are_windows_and_its_workers_their_ranks(tmp_path: Path):
    # Two ranks (worker names set per rank, as HTA and the PyTorch docs do), two cycles each.
    folder = _touch(tmp_path / "log", "rank0.1700000000000000000.pt.trace.json.gz",
                    "rank0.1700000009000000000.pt.trace.json.gz", "rank1.1700000000000400000.pt.trace.json.gz",
                    "rank1.1700000009000300000.pt.trace.json.gz")
    plan = plan_runs(folder)
    assert plan.kind == "window"
    assert [[f.name[:9] for f in run.files] for run in plan.runs] == [["rank0.170", "rank1.170"]] * 2
    assert [run.files[0].name for run in plan.runs] == ["rank0.1700000000000000000.pt.trace.json.gz",
                                                         "rank0.1700000009000000000.pt.trace.json.gz"]


@pytest.mark.parametrize(("names", "kind", "runs"), [
    # The default worker name, a host name with dots and a pid: three cycles of one process.
    (["ip-10-0-0-1.ec2.internal_4242.1795734300502295148.pt.trace.json",
      "ip-10-0-0-1.ec2.internal_4242.1795734300583039264.pt.trace.json",
      "ip-10-0-0-1.ec2.internal_4242.1795734300683039264.pt.trace.json"], "window", 3),
    # One file per worker: the ranks of one run (two processes on the same host).
    (["node_11.1795734300502295148.pt.trace.json", "node_12.1795734300502299999.pt.trace.json"], "run", 1),
    # HTA's per-rank names: one run.
    (["rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz", "rank-1.Apr_03_18_51_38.1103.pt.trace.json.gz"], "run", 1),
    # Names not torch's handler's: one run, as before.
    (["a.json", "b.json"], "run", 1),
])
def test_which_files_are_windows(tmp_path: Path, names: list[str], kind: str, runs: int):
    plan = plan_runs(_touch(tmp_path / "log", *names))
    assert (plan.kind, len(plan.runs)) == (kind, runs)


def test_a_profiler_schedules_cycles_are_analysed_one_by_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The real profiler's schedule (repeat=2) and handler around a real generate(): two files, two
    windows of one process, each with its own steps, and no second rank."""
    model = tiny_llama()
    folder = tmp_path / "log"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=1, repeat=2),
                 on_trace_ready=tensorboard_trace_handler(str(folder))) as prof:
        for _ in range(4):
            generate(model)
            prof.step()
    assert len(list(folder.iterdir())) == 2
    assert main(["analyze", str(folder), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "2 profiler windows (torch.profiler cycles of the same workers, not ranks)" in printed
    report = orjson.loads((tmp_path / "r.json").read_bytes())
    assert len(report["sessions"]) == 2
    for window in report["sessions"]:
        steps = window["summary"]["steps"]
        assert steps["count"] == NEW_TOKENS and steps["source"] == ["embedding"]
        assert [row["rank"] for row in window["summary"]["utilisation"]["aggregates"]] == [0]
