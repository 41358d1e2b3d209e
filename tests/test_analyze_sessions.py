"""`servprof analyze` on folders: servprof's own output folder (several sessions, sidecar JSON
files beside the traces), and folders whose files are not one job's ranks."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import PUBLIC_TRACES, fixture

from servprof.cli import main
from servprof.detect.analysis import analyse
from servprof.trace import load_trace


def _servprof_out(root: Path) -> Path:
    """A folder laid out as servprof writes it: traces/<session>.pt.trace.json.gz with its
    .session.json and .analysis.json, and the demo's own JSON files at the top."""
    traces = root / "traces"
    traces.mkdir(parents=True)
    for index, (session, name) in enumerate([("s-old", "clean"), ("s-new", "step_delay_20ms")]):
        trace = traces / f"{session}.pt.trace.json.gz"
        shutil.copyfile(fixture(name), trace)
        (traces / f"{session}.session.json").write_bytes(orjson.dumps({"session_id": session, "requests": []}))
        (traces / f"{session}.analysis.json").write_bytes(orjson.dumps({"session_id": session, "findings": []}))
        os.utime(trace, ns=(10**18 + index * 10**9, 10**18 + index * 10**9))
    for name in ("report.json", "analysis.json", "demo.json", "harness-summary.json"):
        (root / name).write_bytes(b'{"not": "a trace"}')
    return root


@pytest.mark.parametrize("where", ["root", "traces"])
def test_servprof_output_folder_is_analysed_session_by_session(tmp_path: Path, capsys, where: str):
    root = _servprof_out(tmp_path / "servprof-out")
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    path = root if where == "root" else root / "traces"
    assert main(["analyze", str(path), "--json", str(out_json), "--html", str(out_html)]) == 0
    printed = capsys.readouterr().out
    assert "2 servprof sessions" in printed and "session s-old" in printed and "session s-new" in printed
    report = orjson.loads(out_json.read_bytes())
    assert report["summary"]["sessions"] == ["s-old", "s-new"]  # oldest first
    assert [s["session"] for s in report["sessions"]] == ["s-old", "s-new"]
    # Each session analysed on its own: the clean one has no decode gap worth a warning (its loop's
    # per-step host read is named at info on a CPU trace), the delayed one has its gap.
    kinds = {s["session"]: {f["kind"] for f in s["findings"] if f["severity"] != "info"} for s in report["sessions"]}
    assert "decode_gap" not in kinds["s-old"] and "decode_gap" in kinds["s-new"]
    assert {f["session"] for f in report["findings"] if f["kind"] == "decode_gap" and f["severity"] != "info"} == {"s-new"}
    for session in report["sessions"]:
        assert session["summary"]["ranks"] == [0]  # sessions are not ranks of one run
        assert not any("claim rank" in w for w in session["summary"]["warnings"])
    page = out_html.read_text()
    assert page.count("<h1 id=") == 2 and "session s-new" in page


def test_a_folder_of_one_session_trace_and_its_sidecars(tmp_path: Path):
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copyfile(fixture("clean"), traces / "only.pt.trace.json.gz")
    (traces / "only.session.json").write_text("{}")
    (traces / "only.analysis.json").write_text("{}")
    out = tmp_path / "r.json"
    assert main(["analyze", str(traces), "--json", str(out)]) == 0
    assert orjson.loads(out.read_bytes())["summary"]["events"] > 0  # one run: the usual report


def _rank_file(path: Path, rank: int | None) -> Path:
    document = orjson.loads(gzip.decompress(fixture("clean").read_bytes()))
    if rank is None:
        document.pop("distributedInfo", None)
    else:
        document["distributedInfo"] = {"rank": rank, "world_size": 2}
    path.write_bytes(gzip.compress(orjson.dumps(document)))
    return path


def test_two_files_claiming_one_rank_are_analysed_one_by_one(tmp_path: Path, capsys):
    """Two files that claim rank 0 are not one job's ranks (a folder of downloaded traces, one
    worker's windows renamed): each is analysed on its own, and the report says why. A library
    caller that loads the folder as one trace still gets the warning."""
    run = tmp_path / "run"
    run.mkdir()
    _rank_file(run / "a.json.gz", 0)
    _rank_file(run / "b.json.gz", 0)
    out = tmp_path / "r.json"
    assert main(["analyze", str(run), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 traces that are not one job's ranks (a.json.gz, b.json.gz all claim rank 0), each analysed on its own" \
        in " ".join(printed.split())
    report = orjson.loads(out.read_bytes())
    assert report["summary"]["sessions"] == [str(run / "a.json.gz"), str(run / "b.json.gz")]
    for one in report["sessions"]:
        assert one["summary"]["ranks"] == [0] and one["summary"]["events"] > 0
        assert not [w for w in one["summary"]["warnings"] if "claim rank" in w]
    merged = analyse(load_trace(run)).summary
    assert merged["ranks"] == [0, 1]  # kept apart
    (warning,) = [w for w in merged["warnings"] if "claim rank" in w]
    assert "2 files claim rank 0 (a.json.gz, b.json.gz)" in warning


def _public_rank(path: Path, name: str, rank: int, world_size: int) -> Path:
    document = orjson.loads(gzip.decompress((PUBLIC_TRACES / name).read_bytes()))
    document["distributedInfo"] = {"rank": rank, "world_size": world_size}
    path.write_bytes(gzip.compress(orjson.dumps(document)))
    return path


def test_ranks_of_different_devices_or_world_sizes_are_not_one_job(tmp_path: Path):
    """Each file is judged against the device it ran on: an MI300X's kernels against a V100's
    peak bandwidth would be "faster than the device can go"."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _public_rank(mixed / "r0.json.gz", "hta_cuda_event_sync_a100.json.gz", 0, 2)
    _public_rank(mixed / "r1.json.gz", "sglang_qwen3_8b_decode_bs32_mi300x.json.gz", 1, 2)
    out = tmp_path / "r.json"
    assert main(["analyze", str(mixed), "--json", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    assert [s["summary"]["bandwidth"]["device"]["name"] for s in report["sessions"]] == \
        ["NVIDIA A100 SXM4 80GB", "AMD Instinct MI300X"]
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    _rank_file(sizes / "r0.json.gz", 0)
    document = orjson.loads(gzip.decompress((sizes / "r0.json.gz").read_bytes()))
    document["distributedInfo"] = {"rank": 1, "world_size": 4}
    (sizes / "r1.json.gz").write_bytes(gzip.compress(orjson.dumps(document)))
    assert main(["analyze", str(sizes), "--json", str(out)]) == 0
    assert len(orjson.loads(out.read_bytes())["sessions"]) == 2
    same = tmp_path / "same"
    same.mkdir()
    _public_rank(same / "r0.json.gz", "hta_cuda_event_sync_a100.json.gz", 0, 2)
    _public_rank(same / "r1.json.gz", "hta_cuda_event_sync_a100.json.gz", 1, 2)
    assert main(["analyze", str(same), "--json", str(out)]) == 0
    assert orjson.loads(out.read_bytes())["summary"]["ranks"] == [0, 1]  # one job: one run


def test_distinct_ranks_and_unranked_files_give_no_warning(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    _rank_file(run / "r0.json.gz", 0)
    _rank_file(run / "r1.json.gz", 1)
    out = tmp_path / "r.json"
    assert main(["analyze", str(run), "--json", str(out)]) == 0
    summary = orjson.loads(out.read_bytes())["summary"]
    assert summary["ranks"] == [0, 1] and not [w for w in summary["warnings"] if "claim rank" in w]
    plain = tmp_path / "plain"
    plain.mkdir()
    _rank_file(plain / "x.json.gz", None)
    _rank_file(plain / "y.json.gz", None)
    assert main(["analyze", str(plain), "--json", str(out)]) == 0
    assert not [w for w in orjson.loads(out.read_bytes())["summary"]["warnings"] if "claim rank" in w]


def test_a_frontends_cpu_trace_beside_the_workers_is_not_a_rank(tmp_path: Path, capsys):
    """vLLM's profiler folder: the workers' `dp0_pp0_tp{N}_..._rank{N}.<ns>.pt.trace.json.gz` and the
    API server's CPU-only `<host>_<pid>.async_llm.<ns>.pt.trace.json.gz`. The workers stay one job's
    ranks, analysed together; the API server's trace, another process, is analysed on its own (before,
    it was merged as rank 2 of the job). Here the workers are two ranks of a public vLLM trace and the
    API server's stand-in is a CPU server's trace of servprof's own (no vLLM engine runs here)."""
    run = tmp_path / "vllm_profile"
    run.mkdir()
    for rank in (0, 1):
        _public_rank(run / f"dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}.17640000000000{rank}0000.pt.trace.json.gz",
                     "vllm_decode_bs32_fullgraph_mi300x.json.gz", rank, 2)
    frontend = run / "myhost_4242.async_llm.1764000000100000000.pt.trace.json.gz"
    shutil.copyfile(fixture("clean"), frontend)
    (run / "dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt").write_text("a table, not a trace\n")
    out = tmp_path / "r.json"
    assert main(["analyze", str(run), "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"2 runs: the ranks that ran on a device, analysed together, and each trace of another process on its own " \
           f"({frontend.name} recorded no device work beside ranks that did" in printed
    report = orjson.loads(out.read_bytes())
    assert report["summary"]["sessions"] == [str(run), str(frontend)]
    workers, api = (one["summary"] for one in report["sessions"])
    assert workers["ranks"] == [0, 1] and workers["device_events"]
    assert workers["bandwidth"]["device"]["name"] == "AMD Instinct MI300X"
    assert api["ranks"] == [0] and not api["device_events"]
    # Without it, every file holds device work: one job, one run, as before.
    frontend.unlink()
    assert main(["analyze", str(run), "--json", str(out)]) == 0
    assert orjson.loads(out.read_bytes())["summary"]["ranks"] == [0, 1]
