"""`servprof analyze PATH [--json OUT] [--html OUT] [--device NAME]`.

Loads a torch.profiler / Kineto trace (file or directory of per-rank files), runs
every detector and prints the findings. servprof's own output folder works too: its
session traces are analysed one by one (servprof's .session.json / .analysis.json files
beside them are skipped). Bad input ends with one line on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from servprof.detect.analysis import Analysis, analyse
from servprof.detect.devices import DEVICES, UnknownDevice
from servprof.report.run_plan import (
    Plan,
    Run,
    apart_reason,
    host_only_files,
    host_only_reason,
    plan_runs,
    servprof_sessions_dir,
    session_records,
)
from servprof.trace import Trace, TraceError, load_trace, phase_events, request_phases
from servprof.trace.allocator import keep_freed_memory_for_reuse
from servprof.trace.loader import trace_files

if TYPE_CHECKING:
    from rich.console import Console

# rich (and the report's tables) are imported only to print: `--json -` on a small trace would
# spend a fifth of its fresh process importing them.
EXIT_BAD_INPUT = 2
RUNS_TEXT = {
    "session": "{n} servprof sessions, each analysed on its own (oldest first)",
    "window": "{n} profiler windows (torch.profiler cycles of the same workers, not ranks), each analysed on its "
              "own (oldest first)",
    "run": "{n} runs, each analysed on its own",
    "apart": "{n} traces that are not one job's ranks ({why}), each analysed on its own",
    "host_only": "{n} runs: the ranks that ran on a device, analysed together, and each trace of another process "
                 "on its own ({why})",
    "paths": "{n} traces, each analysed on its own (give a directory to analyse the per-rank files of one job "
             "together)",
}
PROGRESS_MIN_BYTES = 20 * 1024**2  # show a progress display for inputs bigger than this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="+", help="a .json / .json.gz trace (a file, a pipe, or '-': standard input), or "
                                                "a directory of per-rank traces; several are analysed one by one")
    parser.add_argument("--json", dest="json_out", metavar="OUT",
                        help="write the JSON report here ('-': to stdout, instead of the terminal report)")
    parser.add_argument("--html", dest="html_out", metavar="OUT", help="write the HTML report here")
    parser.add_argument("--device", help=f"device to judge kernels against: {', '.join(DEVICES)}, or 'calibrated' "
                                         "(default: the trace's GPU, else the saved calibration, else generic CPU)")


def build_report(analysis: Analysis, requests: dict[str, Any]) -> dict[str, Any]:
    return {"summary": analysis.summary, "findings": [f.to_dict() for f in analysis.findings], "requests": requests}


def run(args: argparse.Namespace) -> int:
    keep_freed_memory_for_reuse()  # (this process only analyses: trace/allocator.py)
    paths = [args.path] if isinstance(args.path, str) else args.path
    try:
        sources = [servprof_sessions_dir(Path("/dev/stdin" if p == "-" else p)) for p in paths]
        plans = [plan_runs(one) for one in sources]
        source = str(sources[0]) if len(paths) == 1 else " ".join(paths)
        plan = plans[0] if len(plans) == 1 else Plan([run for one in plans for run in one.runs],
                                                     [f for one in plans for f in one.files], "paths")
        runs = plan.runs
        files = plan.files
        show = sum(f.stat().st_size for f in files) >= PROGRESS_MIN_BYTES
        progress = _progress() if show else None
        with progress or nullcontext():
            # Three stages per file (read, parse, columns), then the detectors once per run.
            total = 3 * len(files) + len(runs)
            task = progress.add_task("reading", total=total) if progress else None

            def advance(stage: str) -> None:
                if progress is not None and task is not None:
                    following = {"read": "parsing JSON", "parse": "building columns", "columns": "reading"}[stage]
                    progress.update(task, advance=1, description=following)

            apart: str | None = None  # why a directory's files were analysed one by one
            apart_kind = "apart"
            index = 0
            while index < len(runs):
                item = runs[index]
                item.trace = load_trace(item.path, progress=advance, files=item.files, read_args=True)
                before = len(runs)
                replaced = _not_one_job(runs, index)
                if replaced is not None:  # its files are analysed as runs[index:] say instead
                    (apart_kind, apart), again = replaced, len(runs) - before + 1
                    total += 3 * again + again - 1  # (each file read again, and one analysis each)
                    if progress is not None and task is not None:
                        progress.update(task, total=total)
                    continue
                index += 1
                if progress is not None and task is not None:
                    progress.update(task, description=f"analysing {len(item.trace)} events")
                records = session_records(item.path) if item.files is None and item.path.is_file() else None
                item.analysis = analyse(item.trace, records, device=args.device)
                if progress is not None and task is not None:
                    progress.update(task, advance=1)
                requests = {rid: {"phases": phases} for rid, phases in request_phases(item.trace).items()}
                item.report = build_report(item.analysis, requests)
        if apart and plan.kind == "run":
            plan.kind = apart_kind
        report = runs[0].report if len(runs) == 1 else sessions_report(source, runs)
        if args.json_out:
            document = orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
            if args.json_out == "-":  # as jq and friends expect: the JSON alone on stdout
                sys.stdout.buffer.write(document + b"\n")
                sys.stdout.flush()
            else:
                Path(args.json_out).write_bytes(document)
        if args.html_out:
            from servprof.report.html import render, render_sessions

            pages = [(item.label, item.analysis, _tokenize_spans(item.trace)) for item in runs]
            html = render(pages[0][1], pages[0][2]) if len(runs) == 1 else \
                render_sessions(source, pages, RUNS_TEXT[plan.kind].format(n=len(runs), why=apart),
                                [_heading(plan.kind, item.label) for item in runs])
            Path(args.html_out).write_text(html, encoding="utf-8")
    except (TraceError, UnknownDevice) as exc:
        print(f"servprof analyze: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError:
        print(f"servprof analyze: {' '.join(paths)}: not enough memory to load this trace", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # an output path that cannot be written
        print(f"servprof analyze: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json_out == "-":  # stdout is the JSON's: what the terminal report would warn of goes to stderr
        warnings = [w for item in runs for w in (item.analysis.summary.get("warnings") or [])]
        if warnings:
            from rich.console import Console
            from rich.text import Text

            err = Console(stderr=True)
            for warning in warnings:
                err.print(Text.assemble(("warning:", "yellow"), f" {warning}"))
        return 0
    from rich.console import Console
    from rich.text import Text

    # Piped output gets a fixed, readable width instead of 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if len(runs) > 1:
        console.print(Text.assemble((source, "bold"), f": {RUNS_TEXT[plan.kind].format(n=len(runs), why=apart)}"))
    for item in runs:
        # (A trace named on the command line heads its report with its path already.)
        named = len(runs) > 1 and not (plan.kind in ("paths", "apart", "host_only")
                                        and item.label == item.report["summary"]["source"])
        print_analysis(item.analysis, console, session=_heading(plan.kind, item.label) if named else None)
    return 0


def _not_one_job(runs: list[Run], index: int) -> tuple[str, str] | None:
    """A directory loaded as one job's ranks whose files are not: (the plan kind, why) of what
    replaced its run (each file read again: the merged columns cannot be told apart cheaply, and
    such folders are rare). Files that are not one job's (run_plan.apart_reason): one run per file.
    Files that recorded no device work beside ranks that did (run_plan.host_only_files): the ranks
    stay one run, each of the others is a run of its own."""
    item = runs[index]
    if item.files is not None or item.trace is None or len(item.trace.metadata) < 2 or not item.path.is_dir():
        return None
    why = apart_reason(item.trace)
    if why is not None:
        runs[index:index + 1] = [Run(str(f), f) for f in trace_files(item.path)]
        return "apart", why
    hosts = host_only_files(item.trace)
    if not hosts:
        return None
    files = trace_files(item.path)
    ranks = [f for f in files if f.name not in hosts]
    runs[index:index + 1] = [Run(str(item.path), item.path, ranks),
                             *(Run(str(f), f) for f in files if f.name in hosts)]
    return "host_only", host_only_reason(hosts)


def _heading(kind: str, label: str) -> str:
    return f"session {label}" if kind == "session" else label


def _progress() -> Any:
    """The progress display for a big input, on stderr (imported only then: rich.progress is a
    tenth of the imports of a small trace's whole analysis)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _tokenize_spans(trace: Trace | None) -> list[tuple[float, float, str]]:
    if trace is None:
        return []
    return [(e.start_us, e.end_us, ",".join(e.request_ids)) for e in phase_events(trace) if e.phase == "tokenize"]


def sessions_report(source: str, runs: list[Run]) -> dict[str, Any]:
    """Several sessions in one folder (or several traces named): each one's report, and every
    finding tagged with its session."""
    findings = [{**f, "session": item.label} for item in runs for f in item.report["findings"]]
    warnings = [f"{item.label}: {w}" for item in runs for w in item.report["summary"].get("warnings", [])]
    return {"summary": {"source": source, "sessions": [item.label for item in runs], "warnings": warnings},
            "findings": findings, "sessions": [{"session": item.label, **item.report} for item in runs]}


def print_analysis(analysis: Analysis | None, console: Console, session: str | None = None) -> None:
    """The whole terminal report in one console.print of Text and tables (no markup to parse, no
    highlighting regexes: each print call and each parsed string costs rich set-up time)."""
    from rich.console import Group
    from rich.text import Text

    from servprof.report.findings_table import findings_renderables
    from servprof.report.memory_compile import section_renderables as memory_compile_renderables
    from servprof.report.utilisation import utilisation_renderables

    if analysis is None:
        return
    s = analysis.summary
    head = f"{session}: " if session else ""
    headline = Text.assemble((f"{head}{s['source']}", "bold"),
                             f": {s['events']} events, {s['steps']['count']} model steps {s['steps']['by_kind']}, "
                             f"device: {s['bandwidth']['device']['name']}")
    console.print(Group(headline,
                        *utilisation_renderables(s),  # per-step busy / idle first, then servprof's own overhead
                        *findings_renderables(s, [f.to_dict() for f in analysis.findings]),  # warnings, missing, findings
                        *memory_compile_renderables(s)))
