"""The step/gap parts of the reports: the per-step utilisation table, the HTA-style idle split,
servprof's own overhead and what the trace could not show, for the terminal and the HTML."""

from __future__ import annotations

import html
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

UTILISATION_COLUMNS = ("rank", "kind", "steps", "step ms", "busy", "idle inside", "idle between")
SPLIT_COLUMNS = ("rank", "stream", "host_wait", "kernel_wait", "other")
SPLIT_INLINE_ROWS = 4  # more streams than this (ranks x streams) are a table


def _ms_pct(row: dict[str, Any], key: str) -> str:
    median, pct = row['median_' + key], row[key.replace('_ms', '') + '_pct']
    if median is None or pct is None:
        return "n/a"  # not recorded (a light CPU trace does not split a step's time)
    return f"{median:.2f} ms ({pct:.0f}%)"


def utilisation_rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row per rank and step kind: median per step in ms, and share of all the steps' time."""
    rows = []
    for agg in (summary.get("utilisation") or {}).get("aggregates", []):
        rows.append([str(agg["rank"]), agg["kind"], str(agg["steps"]), f"{agg['median_step_ms']:.2f}",
                     _ms_pct(agg, "busy_ms"), _ms_pct(agg, "idle_inside_ms"), _ms_pct(agg, "idle_between_ms")])
    return rows


def utilisation_caption(summary: dict[str, Any]) -> str:
    util = summary.get("utilisation") or {}
    sources = step_sources_text(util.get("sources") or {})
    if util.get("mode") == "device":
        where = ("device timeline (busy = any kernel, copy or memset running; the step is its device span, "
                 "idle between = since the previous step's device work ended)")
    else:
        # (A trace can hold device events that no launch of the steps' threads links to them: an
        # accelerator whose runtime calls servprof does not read, or device work outside every step.)
        why = ("no launch it records ties the trace's device events to these steps" if summary.get("device_events")
               else "no device events in this trace")
        where = (f"host timeline: {why} (busy = work recorded on the step's thread; idle = time it recorded "
                 "nothing)")
    note = f" ({util['note']})" if util.get("note") else ""
    return (f"Per-step utilisation on the {where}{note}. Median per step, and share of all steps' time. "
            f"Steps from {sources}.")


def step_sources_text(sources: dict[str, str]) -> str:
    """"rank 0: ProfilerStep#N", or for a folder of ranks one entry per form, its ranks listed
    ("ranks 0-7: ProfilerStep#N"), not one per rank."""
    by_label: dict[str, list[int]] = {}
    for rank, label in sources.items():
        by_label.setdefault(label, []).append(int(rank))
    return ", ".join(f"{_ranks_text(sorted(ranks))}: {label}" for label, ranks in by_label.items())


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def utilisation_renderables(summary: dict[str, Any]) -> list[RenderableType]:
    """The table an operator needs first, then the idle split and servprof's overhead (what is missing
    is printed with the findings). Text, not markup strings: nothing for rich to parse or highlight."""
    out: list[RenderableType] = []
    rows = utilisation_rows(summary)
    if rows:
        table = Table(title="GPU utilisation per step" if (summary.get("utilisation") or {}).get("mode") == "device"
                      else "Host utilisation per step", title_justify="left")
        for column in UTILISATION_COLUMNS:
            table.add_column(column, justify="left" if column in ("rank", "kind") else "right", no_wrap=True)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))
        out.append(table)
        out.append(Text.assemble((utilisation_caption(summary), "dim")))
    split = idle_split_rows(summary)
    if len(split) > SPLIT_INLINE_ROWS:  # (a folder of ranks, each with its streams: a table, not a paragraph)
        table = Table(title="Idle split per stream (HTA's rule): time / gaps", title_justify="left")
        for column in SPLIT_COLUMNS:
            table.add_column(column, justify="left" if column in ("rank", "stream") else "right", no_wrap=True)
        for row in split:
            table.add_row(*(Text(cell) for cell in row))
        out.append(table)
    elif split:
        out.append(Text("Idle split per stream (HTA's rule): " + "; ".join(
            f"rank {r[0]} stream {r[1]}: host_wait {r[2]}, kernel_wait {r[3]}, other {r[4]}" for r in split)))
    overhead = summary.get("servprof_overhead")
    if isinstance(overhead, dict) and overhead.get("message"):
        out.append(Text.assemble(("servprof overhead:", "dim"), f" {overhead['message']}"))
    return out


def print_utilisation(summary: dict[str, Any], console: Console) -> None:
    console.print(Group(*utilisation_renderables(summary)))


def idle_split_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in (summary.get("decode_gap") or {}).get("idle_split", []):
        out.append([str(s["rank"]), str(s["stream"]), f"{s['host_wait_us'] / 1000:.2f} ms / {s['host_wait_gaps']}",
                    f"{s['kernel_wait_us'] / 1000:.2f} ms / {s['kernel_wait_gaps']}",
                    f"{s['other_us'] / 1000:.2f} ms / {s['other_gaps']}"])
    return out


# --- HTML ------------------------------------------------------------------------------------

WIDTH = 960
PART_COLORS = {"busy": "#4c78a8", "idle inside": "#e45756", "idle between": "#f2a541", "step (not split)": "#9e9e9e"}


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def utilisation_html(summary: dict[str, Any]) -> str:
    """The utilisation table, a stacked bar per step (busy / idle inside / idle between, % of the
    step's cycle), the idle split, servprof's overhead and what the trace could not show."""
    parts = [missing_html(summary)]
    rows = utilisation_rows(summary)
    if rows:
        parts.append(f"<p>{_esc(utilisation_caption(summary))}</p>{_table(UTILISATION_COLUMNS, rows)}")
        parts.append(step_bars_svg(summary))
    else:
        parts.append("<p>No model steps: no per-step utilisation.</p>")
    split = idle_split_rows(summary)
    if split:
        parts.append("<p>Idle split per stream, HTA's rule (time / gaps): host_wait = the device waited for the "
                     "host to launch; kernel_wait = under 30 µs between queued work; other = the rest.</p>")
        parts.append(_table(SPLIT_COLUMNS, split))
    overhead = summary.get("servprof_overhead")
    if isinstance(overhead, dict) and overhead.get("message"):
        parts.append(f"<p><b>servprof's own overhead:</b> {_esc(overhead['message'])}</p>")
    return "".join(parts)


def missing_html(summary: dict[str, Any]) -> str:
    items = "".join(f"<li><b>{_esc(m.get('what', ''))}</b>: {_esc(m.get('message', ''))}</li>"
                    for m in summary.get("missing") or [] if isinstance(m, dict))
    return f"<ul>{items}</ul>" if items else ""


def _bar_parts(row: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(label, % of the cycle, ms) from the top of a step's bar; a step whose time is not split
    (busy null: a light CPU trace) is one part."""
    if row["busy_pct"] is None:
        return [("idle between", row["idle_between_pct"], row["idle_between_ms"]),
                ("step (not split)", 100.0 - row["idle_between_pct"], row["step_ms"])]
    return [(label, row[key], row[key.replace("_pct", "_ms")]) for label, key in (
        ("idle between", "idle_between_pct"), ("idle inside", "idle_inside_pct"), ("busy", "busy_pct"))]


def step_bars_svg(summary: dict[str, Any], limit: int = 400) -> str:
    steps = (summary.get("utilisation") or {}).get("steps", [])[:limit]
    if not steps:
        return ""
    height, left, bottom = 160, 50, 40
    bar = (WIDTH - left - 20) / len(steps)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height + bottom + 20}">']
    unsplit = False
    for i, row in enumerate(steps):
        y = 10.0
        x = left + i * bar
        for label, pct, ms in _bar_parts(row):
            unsplit |= label == "step (not split)"
            h = height * pct / 100
            svg.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar - 0.5, 0.5):.1f}" height="{h:.1f}" '
                       f'fill="{PART_COLORS[label]}"><title>rank {row["rank"]} {_esc(row["kind"])} step {row["index"]}: '
                       f'{label} {ms:.3f} ms ({pct:.1f}% of {row["cycle_ms"]:.3f} ms)</title></rect>')
            y += h
    for pct in (0, 50, 100):
        y = 10 + height * (1 - pct / 100)
        svg.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#333"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{pct}%</text>')
    svg.append(f'<text x="{left}" y="{height + 26}" font-size="11">steps in time order (first {len(steps)}), '
               f'one bar each: share of the step\'s cycle</text>')
    svg.append(f'<text x="12" y="{10 + height / 2}" font-size="11" transform="rotate(-90 12 {10 + height / 2})" '
               f'text-anchor="middle">% of step</text>')
    legend = " ".join(f'<span style="display:inline-block;width:10px;height:10px;background:{c}"></span> {_esc(k)}'
                      for k, c in PART_COLORS.items() if unsplit or k != "step (not split)")
    svg.append("</svg>")
    return f"<p>{legend}</p>" + "".join(svg)
