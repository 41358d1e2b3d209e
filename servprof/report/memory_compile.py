"""The memory and torch.compile sections of the reports (terminal and HTML), from the
analysis summary's ``memory`` and ``compile`` keys (servprof.detect.memory, .recompilation)."""

from __future__ import annotations

import html
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

MIB = 1024**2


def _mib(value: Any) -> str:
    return f"{value / MIB:,.1f} MiB" if isinstance(value, (int, float)) else "-"


def _kept(phase: str, kept_bytes: float) -> str:
    """A phase's net bytes: kept when it allocated more than it freed, freed (memory that other
    phases allocated) when less; never a negative 'kept'."""
    return f"{phase} kept {_mib(kept_bytes)}" if kept_bytes >= 0 else f"{phase} freed {_mib(-kept_bytes)}"


def memory_rows(summary: dict[str, Any]) -> list[dict[str, str]]:
    """One row per device: what the trace and servprof's readings show."""
    memory = summary.get("memory") or {}
    history = memory.get("between_sessions") or {}
    rows = []
    for device in sorted({*(memory.get("devices") or {}), *history}):
        info = (memory.get("devices") or {}).get(device, {})
        between = history.get(device) or {}
        growth = "-"
        if between.get("model_requests"):
            growth = (f"{_mib(between['growth_bytes'])} over {between['model_requests']} requests "
                      f"({_mib(between['growth_bytes'] / between['model_requests'])} each)")
        by_phase = ", ".join(_kept(phase, v["kept_bytes"]) for phase, v in (info.get("by_phase") or {}).items())
        top = ", ".join(f"{o['op']} {_mib(o['allocated_bytes'])}" for o in (info.get("top_ops") or [])[:3])
        rows.append({"device": device, "source": info.get("source", "history"),
                     "peak allocated": _mib(info.get("peak_allocated_bytes")),
                     "peak reserved": _mib(info.get("peak_reserved_bytes")),
                     "baseline": _mib(info.get("baseline_bytes")), "transient": _mib(info.get("transient_bytes")),
                     "cached unused": _mib(info.get("cached_unused_at_peak_bytes")),
                     "of total": _mib(info.get("total_bytes")), "between sessions": growth,
                     "allocated most": "; ".join(x for x in (top, by_phase) if x) or "-"})
    return rows


def compile_lines(summary: dict[str, Any]) -> list[str]:
    compiled = summary.get("compile") or {}
    lines = []
    if compiled.get("compiles"):
        torch_ms = compiled.get("torch_reported_ms")
        lines.append(f"{compiled['compiles']} compile(s) in the trace, {compiled['in_steps']} inside model steps: "
                     f"{compiled['stall_ms']:,.0f} ms stalled" + (f" (torch's own records: {torch_ms:,.0f} ms)"
                                                                 if torch_ms is not None else ""))
    before = compiled.get("before_session") or {}
    if before.get("compiles"):
        lines.append(f"{before['compiles']} compile(s) while serving before this session: {before['ms']:,.0f} ms "
                     "(torch's own records)")
    start, end = compiled.get("counters_start") or {}, compiled.get("counters_end") or {}
    if end:
        lines.append(f"graphs {start.get('unique_graphs', '?')} -> {end.get('unique_graphs')}, "
                     f"graph breaks {start.get('graph_breaks', '?')} -> {end.get('graph_breaks')} (process totals)")
    if compiled.get("steps_with_compiled_code"):
        breaks = compiled.get("graph_breaks_per_step")
        lines.append(f"{compiled['steps_with_compiled_code']} steps ran compiled code: "
                     f"{compiled.get('compiled_regions_per_step', 0):g} compiled region(s) per step, "
                     f"graph breaks per step: {'unknown' if breaks is None else f'{breaks:g}'}")
    return lines


def section_renderables(summary: dict[str, Any]) -> list[RenderableType]:
    out: list[RenderableType] = []
    rows = memory_rows(summary)
    if rows:
        table = Table(title="Memory", title_justify="left", show_lines=False)
        columns = ["device", "source", "peak allocated", "peak reserved", "cached unused", "baseline", "transient",
                   "between sessions", "allocated most"]
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*(Text(row[c]) for c in columns))
        out.append(table)
    lines = compile_lines(summary)
    if lines:
        out.append(Text("\n").join([Text.assemble(("torch.compile", "bold")), *(Text(f"  {line}") for line in lines)]))
    return out


def print_section(summary: dict[str, Any], console: Console) -> None:
    console.print(Group(*section_renderables(summary)))


def html_section(summary: dict[str, Any]) -> str:
    rows = memory_rows(summary)
    parts = ["<h2>Memory</h2>"]
    if rows:
        header = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
        parts.append(f"<table><tr>{header}</tr>{body}</table>")
        parts.append("<p>baseline: held throughout (weights, KV cache, caches); transient: on top of it at the peak "
                     "(activations); cached unused: reserved by the CUDA allocator but not allocated.</p>")
    else:
        parts.append("<p>No memory readings in this trace.</p>")
    lines = compile_lines(summary)
    parts.append("<h2>torch.compile</h2>")
    parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>" if lines
                 else "<p>No torch.compile activity in this trace.</p>")
    return "".join(parts)
