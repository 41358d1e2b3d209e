"""`servprof analyze PATH [--json OUT] [--html OUT] [--device NAME]`.

Loads a torch.profiler / Kineto trace (file or directory of per-rank files), runs
every detector and prints the findings. Bad input ends with one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from servprof.detect.analysis import Analysis, analyse
from servprof.detect.devices import DEVICES, UnknownDevice
from servprof.report.memory_compile import print_section as print_memory_compile
from servprof.trace import TraceError, load_trace, phase_events, request_phases
from servprof.trace.loader import trace_files

EXIT_BAD_INPUT = 2
PROGRESS_MIN_BYTES = 20 * 1024**2  # show a progress display for inputs bigger than this
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a .json / .json.gz trace, or a directory of per-rank traces")
    parser.add_argument("--json", dest="json_out", metavar="OUT", help="write the JSON report here")
    parser.add_argument("--html", dest="html_out", metavar="OUT", help="write the HTML report here")
    parser.add_argument("--device", help=f"device to judge kernels against: {', '.join(DEVICES)}, or 'calibrated' "
                                         "(default: the trace's GPU, else the saved calibration, else generic CPU)")


def build_report(analysis: Analysis, requests: dict[str, Any]) -> dict[str, Any]:
    return {"summary": analysis.summary, "findings": [f.to_dict() for f in analysis.findings], "requests": requests}


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        files = trace_files(args.path)
        show = sum(f.stat().st_size for f in files) >= PROGRESS_MIN_BYTES
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                            console=err, transient=True) if show else None
        with progress or nullcontext():
            # Three stages per file (read, parse, columns), then the detectors.
            task = progress.add_task("reading", total=3 * len(files) + 1) if progress else None

            def advance(stage: str) -> None:
                if progress is not None and task is not None:
                    following = {"read": "parsing JSON", "parse": "building columns", "columns": "reading"}[stage]
                    progress.update(task, advance=1, description=following)

            trace = load_trace(args.path, progress=advance)
            if progress is not None and task is not None:
                progress.update(task, description=f"analysing {len(trace)} events")
            analysis = analyse(trace, device=args.device)
            if progress is not None and task is not None:
                progress.update(task, advance=1)
            requests = {rid: {"phases": phases} for rid, phases in request_phases(trace).items()}
        report = build_report(analysis, requests)
        if args.json_out:
            Path(args.json_out).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        if args.html_out:
            from servprof.report.html import render

            spans = [(e.start_us, e.end_us, ",".join(e.request_ids)) for e in phase_events(trace) if e.phase == "tokenize"]
            Path(args.html_out).write_text(render(analysis, spans), encoding="utf-8")
    except (TraceError, UnknownDevice) as exc:
        print(f"servprof analyze: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError:
        print(f"servprof analyze: {args.path}: not enough memory to load this trace", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # an output path that cannot be written
        print(f"servprof analyze: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Piped output gets a fixed, readable width instead of 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    print_findings(analysis, console)
    print_memory_compile(analysis.summary, console)
    return 0


def print_findings(analysis: Analysis, console: Console) -> None:
    s = analysis.summary
    console.print(f"[bold]{s['source']}[/]: {s['events']} events, {s['steps']['count']} model steps "
                  f"{s['steps']['by_kind']}, device: {s['bandwidth']['device']['name']}")
    if not analysis.findings:
        console.print("No findings: no tokenization stall, decode gap or bandwidth-bound decode op stood out.")
        return
    table = Table(show_lines=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("cost ms", justify="right", no_wrap=True)
    table.add_column("requests", max_width=18, overflow="ellipsis")
    table.add_column("finding", ratio=1, min_width=30)
    for f in analysis.findings:
        ids = f"{len(f.request_ids)}: {f.request_ids[0]}" if f.request_ids else "-"
        table.add_row(f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/]", f.kind, f"{f.cost_ms:.2f}", ids, f.title)
    console.print(table)
