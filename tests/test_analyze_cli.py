"""`servprof analyze`: table, JSON and HTML reports; bad input -> one line and exit 2."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import PUBLIC_TRACES, fixture

from servprof.cli import main


def test_json_and_html_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    rc = main(["analyze", str(fixture("step_delay_20ms")), "--json", str(out_json), "--html", str(out_html)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "decode_gap" in printed and "critical" in printed
    report = orjson.loads(out_json.read_bytes())
    assert set(report) >= {"summary", "findings"}
    kinds = [f["kind"] for f in report["findings"]]
    assert "decode_gap" in kinds and "tokenization_stall" not in kinds
    gap = next(f for f in report["findings"] if f["kind"] == "decode_gap")
    assert set(gap) == {"kind", "severity", "cost_ms", "start_us", "end_us", "request_ids", "sampled_request_ids",
                        "title", "evidence", "fix"}
    assert gap["evidence"]["cause"] == "untraced_host_time" and gap["fix"]
    # The injected delay, and the loop's per-step host read (named at info on a CPU trace).
    assert report["summary"]["findings"]["decode_gap"] == 2
    assert set(report["requests"]) == set(gap["request_ids"])
    page = out_html.read_text()
    assert page.startswith("<!doctype html>")
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert page.count("<svg") == 4  # per-step utilisation bars, timeline, gap histogram, roofline
    assert 'fill="#e45756"' in page  # the gaps are drawn on the timeline


def test_json_to_stdout_is_the_json_alone_and_warnings_go_to_stderr(tmp_path: Path):
    """`--json -` writes the report to stdout (for jq and pipes), byte for byte the file's, and
    nothing else there; warnings the terminal report would show go to stderr. (It used to write a
    file named '-'.)"""
    trace = PUBLIC_TRACES / "hta_cuda_event_sync_a100.json.gz"
    command = [sys.executable, "-m", "servprof.cli", "analyze", str(trace), "--device", "l4"]
    piped = subprocess.run([*command, "--json", "-"], capture_output=True, cwd=tmp_path, timeout=120)
    assert piped.returncode == 0 and not (tmp_path / "-").exists()
    written = subprocess.run([*command, "--json", str(tmp_path / "r.json")], capture_output=True, timeout=120)
    assert piped.stdout == (tmp_path / "r.json").read_bytes() + b"\n"
    report = orjson.loads(piped.stdout)
    assert report["summary"]["warnings"]  # an L4's peak contradicted by this A100 trace
    assert b"warning:" in piped.stderr and b"warning:" not in piped.stdout
    assert b"warning:" in written.stdout  # the terminal report, as before


def test_every_public_trace_and_fixture_analyses(tmp_path: Path):
    paths = sorted(PUBLIC_TRACES.glob("*.json.gz")) + sorted(fixture("clean").parent.glob("*.json.gz"))
    assert any(p.parent == PUBLIC_TRACES for p in paths), f"no public traces under {PUBLIC_TRACES}"
    for path in paths:
        out = tmp_path / f"{path.name}.json"
        assert main(["analyze", str(path), "--json", str(out), "--html", str(tmp_path / "r.html")]) == 0, path
        assert orjson.loads(out.read_bytes())["summary"]["events"] > 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.json", "no such file"),
        (lambda d: _write(d / "empty.json", b""), "empty file"),
        (lambda d: _write(d / "text.json", b"hello"), "not valid JSON"),
        (lambda d: _write(d / "nokey.json", b'{"schemaVersion": 1}'), "no 'traceEvents'"),
        (lambda d: _write(d / "cut.json.gz", fixture("clean").read_bytes()[:5000]), "truncated or corrupt gzip"),
        # Other profilers' files: what each is, and how to record what servprof reads.
        (lambda d: _write(d / "tw003.xplane.pb", b"\x0a\x0b/host:CPU\x12\x03abc"), "a TensorBoard / JAX XPlane"),
        (lambda d: _write(d / "run.nsys-rep", b"\x00\x01NSYS report"), "an Nsight Systems report"),
        (lambda d: _write(d / "run.sqlite", b"SQLite format 3\x00\x10\x00"), "an SQLite database"),
        (lambda d: _write(d / "run.pftrace", b"\x0a\x02\x08\x01"), "a protobuf trace"),
        (lambda d: _write(d / "gz.xplane.pb", gzip.compress(b"\x0a\x0b/host:CPU")), "XPlane"),
        (lambda d: _write(d / "kernels.ncu-rep", b"\x00NVIDIA"), "an Nsight Compute report"),
        (lambda d: _write(d / "snapshot.pickle", pickle.dumps({"segments": []}, protocol=4)), "memory_viz"),
        (lambda d: _write(d / "traces.zip", _zipped("t.json", b'{"traceEvents": []}')), "a zip archive"),
        (lambda d: _write(d / "nsys.json", b'{"type": 1}\n{"type": 2}\n'), "one JSON document per line"),
        (lambda d: _write(d / "pyspy.json", orjson.dumps({"$schema": "https://www.speedscope.app/file-format-schema.json",
                                                          "profiles": []})), "a speedscope profile"),
        (lambda d: _write(d / "snap.json", orjson.dumps({"segments": [], "device_traces": []})), "memory_viz"),
        (lambda d: _write(d / "other.json", b'{"version": 2, "samples": []}'), "its keys: 'version', 'samples'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], make, message):
    path = make(tmp_path)
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    if any(word in err for word in ("protobuf", "Nsight", "SQLite", "speedscope", "per line", "its keys")):
        assert "export_chrome_trace" in err


def test_an_execution_trace_is_named_and_its_kineto_trace_asked_for(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]):
    """torch's ExecutionTraceObserver writes a JSON of op nodes that people mistake for the profiler's
    trace (Chakra and PARAM read the two side by side): said what it is, and which file to give."""
    import torch
    from torch.profiler import ExecutionTraceObserver

    path = tmp_path / "rank0_et.json"
    observer = ExecutionTraceObserver().register_callback(str(path))
    observer.start()
    torch.nn.Linear(8, 8)(torch.randn(2, 8)).sum()
    observer.stop()
    observer.unregister_callback()
    assert "nodes" in orjson.loads(path.read_bytes())  # (what the observer really wrote)
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a PyTorch execution trace" in err and "export_chrome_trace" in err and len(err.splitlines()) == 1


def _zipped(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


def test_a_log_dir_of_run_folders_names_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """TensorBoard's log dir holds a folder per run: the error names those that hold traces."""
    for run in ("resnet18", "llama"):
        (tmp_path / "log" / run).mkdir(parents=True)
        _write(tmp_path / "log" / run / "w.1.pt.trace.json.gz", fixture("clean").read_bytes())
    (tmp_path / "log" / "plugins").mkdir()  # (a folder without traces is not named)
    assert main(["analyze", str(tmp_path / "log")]) == 2
    err = capsys.readouterr().err.strip()
    assert "its folders llama, resnet18 do" in err and str(tmp_path / "log" / "llama") in err
    assert len(err.splitlines()) == 1
    assert main(["analyze", str(tmp_path / "log" / "llama")]) == 0


def test_huge_file_and_unknown_device_and_unwritable_output(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("SERVPROF_MAX_TRACE_BYTES", "4096")
    assert main(["analyze", str(fixture("clean"))]) == 2
    assert "SERVPROF_MAX_TRACE_BYTES" in capsys.readouterr().err
    monkeypatch.delenv("SERVPROF_MAX_TRACE_BYTES")
    assert main(["analyze", str(fixture("clean")), "--device", "abacus"]) == 2
    assert "unknown device 'abacus'" in capsys.readouterr().err
    assert main(["analyze", str(fixture("clean")), "--json", str(tmp_path / "no" / "dir.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_command_line_process_prints_no_traceback(tmp_path: Path):
    bad = _write(tmp_path / "bad.json.gz", b"\x1f\x8b\x08\x00garbage")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "servprof.cli", "analyze", str(bad)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("servprof analyze: ") and len(done.stderr.strip().splitlines()) == 1


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_analyze_does_not_import_torch() -> None:
    """`servprof analyze` runs where torch is heavy or absent: only its own module is imported."""
    trace = PUBLIC_TRACES / "vllm_decode_bs32_fullgraph_mi300x.json.gz"
    code = ("import sys; from servprof.cli import main; code = main(['analyze', sys.argv[1]]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")
    done = subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH 0", done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("name", ["hta_mi250_minitoy_train_rocm.json.gz", "kineto_resnet50_autograd_api_v100.json.gz",
                                  "sglang_qwen3_8b_decode_bs32_mi300x.json.gz"])
def test_analyze_to_json_imports_no_terminal_report_and_no_numpy_ma(name: str) -> None:
    """`servprof analyze T --json -` (every detector, the JSON on stdout) pays for neither rich's
    tables nor numpy.ma (np.unique / np.median import it): a fifth of a small trace's fresh process."""
    code = ("import io, sys; from servprof.cli import main; sys.stdout = io.TextIOWrapper(io.BytesIO()); "
            "code = main(['analyze', sys.argv[1], '--json', '-']); sys.stdout = sys.__stdout__; "
            "print(sorted(m for m in ('rich', 'numpy.ma', 'torch') if m in sys.modules), code)")
    done = subprocess.run([sys.executable, "-c", code, str(PUBLIC_TRACES / name)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[] 0", done.stdout[-2000:] + done.stderr[-2000:]


def test_a_command_whose_module_is_missing_says_what_to_install(monkeypatch, capsys: pytest.CaptureFixture[str]):
    """A command's own parser (`servprof demo ...`) and the top-level one (`servprof --x demo`)
    both name the missing extra, whatever the command's arguments, instead of a parse error."""
    import servprof.cli as cli

    monkeypatch.setitem(cli.COMMANDS, "demo", ("servprof_no_such_module", "stand-in for a missing extra"))
    assert main(["demo", "--duration", "5"]) == 2
    assert "servprof demo: unavailable" in capsys.readouterr().err
    assert main(["demo"]) == 2
    assert "pip install 'servprof[demo]'" in capsys.readouterr().err


def test_a_command_parser_matches_its_sub_parser(capsys: pytest.CaptureFixture[str]):
    """`servprof analyze` builds only its own parser: its usage and errors are those of the sub-parser."""
    import servprof.cli as cli

    own = cli.command_parser("analyze")
    sub = cli.build_parser("analyze")._subparsers._group_actions[0].choices["analyze"]  # type: ignore[union-attr]
    assert own.format_help() == sub.format_help()
    with pytest.raises(SystemExit) as exited:
        main(["analyze"])
    assert exited.value.code == 2
    assert "servprof analyze: error: the following arguments are required: path" in capsys.readouterr().err


def test_memory_freed_in_a_phase_is_said_so_never_a_negative_kept():
    """TraceLens's MI300X norm layers: outside the steps the device freed more than it allocated
    (what the steps had allocated). The memory table said "outside_steps kept -13.9 MiB"."""
    from servprof.detect.analysis import analyse
    from servprof.report.memory_compile import memory_rows
    from servprof.trace import load_trace

    summary = analyse(load_trace(PUBLIC_TRACES / "tracelens_norm_layers_mi300x.json.gz")).summary
    phases = summary["memory"]["devices"]["device6:0"]["by_phase"]
    assert phases["outside_steps"]["kept_bytes"] < 0 < phases["step"]["kept_bytes"]  # the JSON keeps the sign
    (row,) = [r for r in memory_rows(summary) if r["device"] == "device6:0"]
    freed = -phases["outside_steps"]["kept_bytes"] / 2**20
    assert f"outside_steps freed {freed:,.1f} MiB" in row["allocated most"] and "kept -" not in row["allocated most"]


def test_a_trace_with_no_finding_says_what_it_saw_under_the_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """One gap between two decode steps, 1.1 ms of an 8.1 ms span (14%): one gap is reported from
    20%, so there is no finding, and the report says what it saw instead of only 'no findings'."""
    from _kineto_builder import KinetoTrace

    trace = KinetoTrace()
    for kind, start, end in (("prefill", 0.0, 4000.0), ("decode_step", 4000.0, 5500.0), ("decode_step", 6600.0, 8100.0)):
        trace.host(f"servprof:{kind}|r1", start, end - start, cat="user_annotation")
    path = trace.write(tmp_path / "t.json")
    assert main(["analyze", str(path), "--json", str(tmp_path / "r.json")]) == 0
    report = orjson.loads((tmp_path / "r.json").read_bytes())
    assert report["findings"] == []
    (below,) = report["summary"]["decode_gap"]["below_bar"]
    assert below["gaps"] == 1 and below["ms"] == pytest.approx(1.1) and below["share"] == pytest.approx(1100 / 8100, abs=1e-4)
    out = " ".join(capsys.readouterr().out.split())
    assert "No findings" in out
    assert "under the bar: 1 gap(s) between decode steps, 1.10 ms (14% of step time; one gap is reported from 20%)" in out


@pytest.mark.parametrize("sidecar", [b"{not json", b"[1, 2]", b'{"requests": 5}',
                                     b'{"requests": [5, "x", {"request_id": "r", "arrival_ns": 1e300, '
                                     b'"arrival_perf_ns": -5, "first_byte_ns": "soon", "end_ns": 1e308}]}'])
def test_a_damaged_session_sidecar_is_read_around(tmp_path: Path, sidecar: bytes) -> None:
    """servprof analyze reads a session trace's request records from its .session.json (queue_wait
    needs them); whatever that file holds, the trace is analysed and the report is JSON."""
    trace = tmp_path / "s1.pt.trace.json.gz"
    trace.write_bytes(fixture("clean").read_bytes())
    (tmp_path / "s1.session.json").write_bytes(sidecar)
    assert main(["analyze", str(trace), "--json", str(tmp_path / "r.json")]) == 0
    report = orjson.loads((tmp_path / "r.json").read_bytes())
    assert report["summary"]["queue_wait"]["requests_timed"] <= 1


@pytest.mark.parametrize("command", [["servprof"], [sys.executable, "-m", "servprof"]], ids=["script", "module"])
def test_the_command_says_its_version_and_runs_as_a_module(command: list[str]) -> None:
    from importlib.metadata import version

    if command == ["servprof"]:
        command = [str(Path(sys.executable).with_name("servprof"))]
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"servprof {version('servprof')}"
    done = subprocess.run([*command, "analyze", str(PUBLIC_TRACES / "hta_cuda_event_sync_a100.json.gz"), "--json", "-"],
                          capture_output=True, timeout=120)
    assert done.returncode == 0 and orjson.loads(done.stdout)["summary"]["events"] > 0


def test_the_command_prints_its_whole_report_through_a_pipe_before_it_exits(tmp_path: Path) -> None:
    """`servprof analyze` skips the interpreter's teardown (cli.console_main): what it wrote to a
    pipe (the JSON, and the terminal report beside a JSON file) arrives whole, and the exit status is
    the command's."""
    script = str(Path(sys.executable).with_name("servprof"))
    trace = PUBLIC_TRACES / "resnet_ddp_training_v100.json.gz"
    done = subprocess.run([script, "analyze", str(trace), "--json", "-"], capture_output=True, timeout=120)
    assert done.returncode == 0 and orjson.loads(done.stdout)["summary"]["events"] > 0
    out = tmp_path / "r.json"
    done = subprocess.run([script, "analyze", str(trace), "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and orjson.loads(out.read_bytes())["findings"] is not None
    assert done.stdout.rstrip().endswith("┘") or "no findings" in done.stdout.lower(), done.stdout[-500:]
    done = subprocess.run([script, "analyze", str(tmp_path / "absent.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("servprof analyze: ")


def test_only_one_shot_commands_skip_the_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """`servprof demo` exits normally (its exit handlers flush spans); `servprof analyze` flushes its
    output and leaves with its status, or 1 when the reader hung up before the flush."""
    import servprof.cli as cli

    class Left(Exception):
        pass

    def leave(code: int) -> None:
        raise Left(code)

    monkeypatch.setattr(cli, "main", lambda argv: 3)
    monkeypatch.setattr(cli.os, "_exit", leave)
    monkeypatch.setattr(sys, "argv", ["servprof", "demo"])
    with pytest.raises(SystemExit) as exited:
        cli.console_main()
    assert exited.value.code == 3
    monkeypatch.setattr(sys, "argv", ["servprof", "analyze", "t.json"])
    with pytest.raises(Left) as left:
        cli.console_main()
    assert left.value.args == (3,)

    class HungUp(io.StringIO):
        def flush(self) -> None:
            raise BrokenPipeError

    monkeypatch.setattr(cli, "main", lambda argv: 0)
    monkeypatch.setattr(sys, "stdout", HungUp())
    with pytest.raises(Left) as left:
        cli.console_main()
    assert left.value.args == (1,)


def test_servprofs_own_files_are_named_with_the_trace_to_analyse(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """People point `servprof analyze` at the report, or a session's files beside its trace."""
    trace = fixture("clean")
    report = tmp_path / "report.json"
    assert main(["analyze", str(trace), "--json", str(report)]) == 0
    session = _write(tmp_path / "s1.session.json", orjson.dumps(
        {"session_id": "s1", "state": "done", "trace_file": str(tmp_path / "s1.pt.trace.json.gz"), "requests": []}))
    harness = _write(tmp_path / "harness-summary.json", orjson.dumps({"completed": 3, "failed": 0, "slo": {}}))
    capsys.readouterr()
    said = []
    for path in (report, session, harness):
        assert main(["analyze", str(path)]) == 2
        said.append(capsys.readouterr().err.strip())
    assert said == [
        f"servprof analyze: {report}: servprof's analysis report, not a trace: it was made from {trace}",
        f"servprof analyze: {session}: a servprof session's description, not a trace: its trace is "
        f"{tmp_path / 's1.pt.trace.json.gz'}",
        f"servprof analyze: {harness}: the locust harness's summary, not a trace: servprof analyze reads "
        "torch.profiler traces"]


def test_several_traces_named_are_analysed_one_by_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`servprof analyze a.json.gz b.json.gz` (a shell glob): each trace its own analysis, in the
    order given, as the same trace alone gives it; one unreadable among them is refused first."""
    first, second = PUBLIC_TRACES / "hta_cuda_event_sync_a100.json.gz", fixture("clean")
    out = tmp_path / "both.json"
    assert main(["analyze", str(first), str(second), "--json", str(out), "--html", str(tmp_path / "r.html")]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["summary"]["sessions"] == [str(first), str(second)]
    for path, one in zip((first, second), report["sessions"], strict=True):
        alone = tmp_path / "alone.json"
        assert main(["analyze", str(path), "--json", str(alone)]) == 0
        assert one["findings"] == orjson.loads(alone.read_bytes())["findings"]
    assert "hta_cuda_event_sync_a100" in (tmp_path / "r.html").read_text(encoding="utf-8")
    capsys.readouterr()
    assert main(["analyze", str(first), str(second)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # (long paths wrap the terminal's lines)
    assert "2 traces, each analysed on its own" in printed
    body = printed[printed.index("on its own"):]  # (after the line that names them all)
    assert 0 <= body.index(f"{first}: ") < body.index(f"{second}: ")
    assert main(["analyze", str(first), str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
