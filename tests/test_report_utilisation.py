"""The step/gap parts of `servprof analyze`'s reports: the utilisation table first in the terminal,
the same figures in the JSON and the HTML, the gaps drawn once on labelled axes, servprof's own
overhead and what the trace could not show."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import public_trace
from _kineto_builder import KinetoTrace, eager_step

from servprof.cli import main


def test_utilisation_comes_first_in_the_terminal_and_matches_the_json(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "r.json"
    assert main(["analyze", str(public_trace("vllm_gptoss_prefill_eager_b200.json.gz")), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.index("GPU utilisation per step") < printed.index("severity")
    (agg,) = orjson.loads(out.read_bytes())["summary"]["utilisation"]["aggregates"]
    row = next(line for line in printed.splitlines() if "prefill" in line and "ms (" in line)
    assert f"{agg['median_busy_ms']:.2f} ms ({agg['busy_pct']:.0f}%)" in row
    assert f"{agg['median_idle_inside_ms']:.2f} ms ({agg['idle_inside_pct']:.0f}%)" in row
    assert "Idle split per stream" in printed and "host_wait" in printed
    assert "  tokenization: " in printed and "vLLM execute" not in printed  # steps from the annotation


def test_html_shows_the_table_and_each_gap_once_on_labelled_axes(tmp_path: Path):
    page_path, out = tmp_path / "r.html", tmp_path / "r.json"
    trace = KinetoTrace()
    t = 0.0
    for _ in range(6):
        trace.host("servprof:decode_step|a", t, 60)
        end = eager_step(trace, t, kernels=8)
        for i in range(12):  # short launch-bound gaps between steps
            trace.launch(end + i * 20, end + 16 + i * 20, 4.0)
        t = end + 12 * 20 + 600  # and a long one before the next step
    path = trace.write(tmp_path / "t.json")
    assert main(["analyze", str(path), "--html", str(page_path), "--json", str(out)]) == 0
    page = page_path.read_text()
    report = orjson.loads(out.read_bytes())
    table = page.split("<h2>Utilisation per step</h2>")[1].split("<h2>Findings")[0]
    assert "<th>idle inside</th>" in table and "<th>idle between</th>" in table
    for label in ("% of step", "time since the first step (ms)", "idle per gap (ms, log scale)", "gaps",
                  "long gaps", "short gaps"):
        assert label in page
    # Every gap the findings count is drawn once on the timeline: long ones red, per-step sums orange.
    timeline = page.split("<h2>Timeline")[1].split("<h2>")[0]
    drawn = len(re.findall(r'<rect[^>]*fill="#e45756"', timeline)) + len(re.findall(r'<rect[^>]*fill="#f2a541"',
                                                                                        timeline))
    gaps = report["summary"]["decode_gap"]
    counted = sum(f["evidence"]["gaps"] for f in report["findings"] if f["kind"] == "decode_gap") + sum(
        g["count"] for g in gaps.get("unreported_gaps", []))
    assert counted == gaps["gaps"]
    assert drawn == len({(f["start_us"], f["end_us"]) for f in
                         [g for f in report["findings"] if f["kind"] == "decode_gap"
                          for g in f["evidence"]["worst_gaps"]] + gaps.get("unreported_gaps", [])})
    rows = report["summary"]["utilisation"]["steps"]
    assert page.count("<title>rank 0 decode step") == 3 * len(rows)  # busy / idle inside / idle between per step


def test_servprofs_overhead_is_shown_as_such(tmp_path: Path, capsys: pytest.CaptureFixture):
    base_ns = 1_700_000_000_000_000
    trace = KinetoTrace()
    trace.metadata = {"baseTimeNanoseconds": base_ns, "servprof": {"stop_wall_ns": base_ns + 2_500_000}}
    for k in range(4):
        trace.host("servprof:decode_step|a", k * 1000.0, 900)
    path = trace.write(tmp_path / "t.json")
    page = tmp_path / "r.html"
    assert main(["analyze", str(path), "--html", str(page)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "servprof overhead: servprof's own stop() began 2.5 ms into the trace" in printed
    assert "servprof's own overhead" in page.read_text()


def test_a_host_table_beside_device_events_it_could_not_tie_does_not_say_there_are_none(tmp_path: Path):
    """Steps read on the host while the trace has device events no launch of theirs links to (an
    accelerator whose runtime calls servprof does not read, as HTA's MTIA traces): the caption says
    that, not "no device events in this trace"."""
    from servprof.detect.analysis import analyse
    from servprof.report.utilisation import utilisation_caption
    from servprof.trace import load_trace

    trace = KinetoTrace()
    for k in range(4):
        trace.annotation(f"ProfilerStep#{k}", k * 5000.0, 4000.0)
        trace.host("aten::linear", k * 5000.0 + 10.0, 3900.0)
        trace.device(k * 5000.0 + 100.0, 3000.0, "gemv_kernel", correlation=10_000 + k)  # no launch records it
    summary = analyse(load_trace(trace.write(tmp_path / "t.json"))).summary
    assert summary["device_events"] and summary["utilisation"]["mode"] == "host"
    caption = utilisation_caption(summary)
    assert "no launch it records ties the trace's device events to these steps" in caption
    assert "no device events" not in caption
    summary["device_events"] = False
    assert "no device events in this trace" in utilisation_caption(summary)


def test_a_folder_of_ranks_is_read_in_tables_not_in_a_paragraph_per_rank(capsys: pytest.CaptureFixture):
    """PARAM's 8-rank DLRM folder, 4 streams a rank: the step forms are said once for the ranks that
    share one, and the 32 streams' idle split is a table."""
    from _analyze_helpers import PUBLIC_TRACES

    assert main(["analyze", str(PUBLIC_TRACES / "param_dlrm_8ranks_v100")]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Steps from ranks 0-7: ProfilerStep#N." in printed and "rank 1: ProfilerStep#N" not in printed
    assert "Idle split per stream (HTA's rule): time / gaps" in printed
    assert "rank 0 stream 7: host_wait" not in printed  # (the one-line form, for a few streams)


def test_step_sources_group_ranks_by_form():
    from servprof.report.utilisation import step_sources_text

    assert step_sources_text({"0": "ProfilerStep#N"}) == "rank 0: ProfilerStep#N"
    assert step_sources_text({"0": "a", "1": "a", "2": "b", "3": "a", "4": "a", "5": "a"}) == "ranks 0, 1, 3-5: a, rank 2: b"
