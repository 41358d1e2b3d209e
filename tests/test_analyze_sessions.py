"""`servprof analyze` on folders: servprof's own output folder (several sessions, sidecar JSON
files beside the traces), and per-rank folders where two files claim the same rank."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import fixture

from servprof.cli import main


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


def test_two_files_claiming_one_rank_are_a_warning_not_a_silent_merge(tmp_path: Path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _rank_file(run / "a.json.gz", 0)
    _rank_file(run / "b.json.gz", 0)
    out = tmp_path / "r.json"
    assert main(["analyze", str(run), "--json", str(out)]) == 0
    summary = orjson.loads(out.read_bytes())["summary"]
    assert summary["ranks"] == [0, 1]  # kept apart
    (warning,) = [w for w in summary["warnings"] if "claim rank" in w]
    assert "2 files claim rank 0 (a.json.gz, b.json.gz)" in warning
    assert "warning:" in capsys.readouterr().out


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
