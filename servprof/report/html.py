"""A self-contained HTML report: findings, a timeline of steps and gaps, a gap
histogram and a roofline plot, drawn as inline SVG (no scripts, nothing fetched)."""

from __future__ import annotations

import html
import math
import re
from typing import Any

import numpy as np

from servprof.detect.analysis import Analysis
from servprof.detect.bandwidth_points import ROOFLINE_POINTS
from servprof.report.memory_compile import html_section as memory_compile_section
from servprof.report.utilisation import utilisation_html

WIDTH, LANE = 960, 18
MAX_TIMELINE_STEPS = 3000
MAX_TIMELINE_GAPS = 5000
MAX_ROOFLINE_POINTS = ROOFLINE_POINTS  # (Analysis.kernels keeps the first this many that can be plotted)
COLORS = {"decode": "#4c78a8", "prefill": "#72b7b2", "mixed": "#54a24b", "step": "#9d755d", "tokenize": "#f58518"}


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _step_window(step: Any) -> tuple[float, float]:
    """Where a step is drawn: its device span when it launched device work, else its host range."""
    if step.device_start_us is not None and step.device_end_us is not None:
        return step.device_start_us, step.device_end_us
    return step.start_us, step.end_us


def timeline_svg(analysis: Analysis, tokenize_spans: list[tuple[float, float, str]]) -> str:
    """Steps (device spans where known), every gap the findings count (each once: long gaps as
    red bars, a step's short gaps summed as one orange bar under the step), and tokenization,
    on one labelled time axis."""
    steps = analysis.steps[:MAX_TIMELINE_STEPS]
    if not steps:
        return "<p>No model steps were found in this trace, so there is no timeline.</p>"
    rank = min(s.rank for s in steps)
    steps = [s for s in steps if s.rank == rank]
    gaps = [g for g in analysis.gaps if g.rank == rank]
    gaps = sorted(gaps, key=lambda g: -g.idle_us)[:MAX_TIMELINE_GAPS]  # the largest, each drawn once
    windows = [_step_window(s) for s in steps]
    t0 = min(w[0] for w in windows)
    t1 = max(w[1] for w in windows)
    for start, end, _ in tokenize_spans:
        t0, t1 = min(t0, start), max(t1, end)
    scale = (WIDTH - 120) / max(t1 - t0, 1.0)

    def x(t: float) -> float:
        return 110 + (t - t0) * scale

    lanes = {"steps": 20, "long gaps": 20 + LANE + 6, "short gaps": 20 + 2 * (LANE + 6),
             "tokenize": 20 + 3 * (LANE + 6)}
    axis_y = lanes["tokenize"] + LANE + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{axis_y + 40}">']
    for label, y in lanes.items():
        parts.append(f'<text x="4" y="{y + 13}" font-size="12">{label}</text>')
    for s, (a, b) in zip(steps, windows, strict=True):
        w = max((b - a) * scale, 0.5)
        parts.append(f'<rect x="{x(a):.1f}" y="{lanes["steps"]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="{COLORS.get(s.kind, "#888")}"><title>{_esc(s.kind)} {_esc(s.label[:80])} '
                     f'{(b - a) / 1000:.2f} ms</title></rect>')
    for g in (g for g in gaps if g.start_us < t1 and g.end_us > t0):
        w = max((g.end_us - g.start_us) * scale, 1.0)
        if g.count > 1:  # a step's short gaps, summed: drawn once under the step they fell in
            lane, color, what = "short gaps", "#f2a541", f"{g.count} short gaps, {g.idle_us / 1000:.3f} ms in all"
        else:
            lane, color, what = "long gaps", "#e45756", f"{g.idle_us / 1000:.3f} ms idle"
        parts.append(f'<rect x="{x(g.start_us):.1f}" y="{lanes[lane]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="{color}"><title>{_esc(g.where.replace("_", " "))}: {what}, {_esc(g.cause)}: '
                     f'{_esc(g.explanation[:300])}</title></rect>')
    for start, end, rid in tokenize_spans:
        w = max((end - start) * scale, 0.5)
        parts.append(f'<rect x="{x(start):.1f}" y="{lanes["tokenize"]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="{COLORS["tokenize"]}"><title>tokenize {_esc(rid)} {(end - start) / 1000:.2f} ms</title></rect>')
    parts.append(f'<line x1="110" y1="{axis_y}" x2="{WIDTH - 10}" y2="{axis_y}" stroke="#333"/>')
    for i in range(6):
        t = (t1 - t0) * i / 5
        parts.append(f'<line x1="{x(t0 + t):.1f}" y1="{axis_y}" x2="{x(t0 + t):.1f}" y2="{axis_y + 4}" stroke="#333"/>'
                     f'<text x="{x(t0 + t):.1f}" y="{axis_y + 16}" font-size="10" text-anchor="middle">'
                     f'{t / 1000:.1f}</text>')
    timeline = "device" if any(s.device_start_us is not None for s in steps) else "host"
    parts.append(f'<text x="110" y="{axis_y + 32}" font-size="11">time since the first step (ms), rank {rank}, '
                 f'{timeline} timeline</text>')
    parts.append("</svg>")
    return "".join(parts)


def histogram_svg(analysis: Analysis) -> str:
    """How long the gaps are: every gap counted once, inside and between steps, on log-spaced
    bins (a step's summed short gaps count as that many gaps of their mean length)."""
    lengths: list[float] = []
    where: list[str] = []
    for g in analysis.gaps:
        if g.cause == "collective_straggler" or g.idle_us <= 0:
            continue
        lengths.extend([g.idle_us / g.count / 1000] * g.count)
        where.extend([g.where] * g.count)
    if not lengths:
        return "<p>No gaps in the steps: nothing to plot.</p>"
    values = np.array(lengths)
    lo, hi = math.log10(max(values.min(), 1e-4)), math.log10(max(values.max(), 1e-4))
    edges = np.logspace(lo, hi + 1e-9, num=min(30, max(5, values.size // 3)) + 1)
    inside = np.array([w == "inside_step" for w in where])
    counts_in, _ = np.histogram(values[inside], bins=edges)
    counts_between, _ = np.histogram(values[~inside], bins=edges)
    height, left, top = 200, 60, max(int((counts_in + counts_between).max()), 1)
    bar_w = (WIDTH - left - 20) / len(counts_in)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height + 60}">']
    for i, (c_in, c_between) in enumerate(zip(counts_in.tolist(), counts_between.tolist(), strict=True)):
        y = 10 + height
        for count, color, label in ((c_in, "#e45756", "inside steps"), (c_between, "#f2a541", "between steps")):
            h = count / top * height
            y -= h
            parts.append(f'<rect x="{left + i * bar_w:.1f}" y="{y:.1f}" width="{bar_w - 1:.1f}" height="{h:.1f}" '
                         f'fill="{color}"><title>{edges[i]:.4f}-{edges[i + 1]:.4f} ms: {count} gaps {label}'
                         f'</title></rect>')
    for i in (0, len(counts_in) // 2, len(counts_in)):
        parts.append(f'<text x="{left + i * bar_w:.1f}" y="{height + 26}" font-size="10" text-anchor="middle">'
                     f'{edges[i]:.3g}</text>')
    parts.append(f'<text x="{left}" y="{height + 44}" font-size="11">idle per gap (ms, log scale); red: inside '
                 f'steps, orange: between steps</text>')
    parts.append(f'<text x="{left - 6}" y="18" font-size="10" text-anchor="end">{top}</text>'
                 f'<text x="{left - 6}" y="{10 + height}" font-size="10" text-anchor="end">0</text>'
                 f'<text x="14" y="{10 + height / 2}" font-size="11" transform="rotate(-90 14 {10 + height / 2})" '
                 f'text-anchor="middle">gaps</text></svg>')
    return "".join(parts)


def roofline_svg(analysis: Analysis) -> str:
    points = [p for p in analysis.kernels if p["flops"] > 0 and p["time_us"] > 0][:MAX_ROOFLINE_POINTS]
    device = analysis.summary.get("bandwidth", {}).get("device", {})
    if not points or not device:
        return "<p>No op with record_shapes that servprof can model: nothing to place on the roofline.</p>"
    bw = (device.get("memory_bandwidth_gbs") or 0) * 1e9
    peak = (device.get("peak_tflops") or 0) * 1e12
    xs = [p["intensity"] for p in points]
    ys = [p["achieved_tflops"] * 1e12 for p in points]
    ridge = peak / bw if bw and peak else None
    x_lo, x_hi = math.log10(min(xs) / 2), math.log10(max(max(xs), ridge or 0) * 4)
    y_lo = math.log10(max(min(ys) / 2, 1.0))
    y_hi = math.log10(max(peak, bw * 10**x_hi if bw else 0, max(ys)) * 2)
    w, h = WIDTH - 100, 320

    def px(v: float) -> float:
        return 70 + (math.log10(v) - x_lo) / (x_hi - x_lo) * w

    def py(v: float) -> float:
        return 10 + h - (math.log10(max(v, 1e-30)) - y_lo) / (y_hi - y_lo) * h

    left, right = 10**x_lo, 10**x_hi
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h + 55}">']
    if bw:  # the memory roof, then the compute roof when the FLOP/s peak is known
        corner, top = (ridge, peak) if ridge else (right, bw * right)
        parts.append(f'<polyline fill="none" stroke="#333" stroke-width="2" points="{px(left):.1f},{py(bw * left):.1f} '
                     f'{px(corner):.1f},{py(top):.1f} {px(right):.1f},{py(peak or bw * right):.1f}"/>')
    # Decade ticks on both log axes.
    for decade in range(math.ceil(x_lo), math.floor(x_hi) + 1):
        parts.append(f'<line x1="{px(10.0**decade):.1f}" y1="{10 + h}" x2="{px(10.0**decade):.1f}" y2="{14 + h}" '
                     f'stroke="#333"/><text x="{px(10.0**decade):.1f}" y="{h + 25}" font-size="10" '
                     f'text-anchor="middle">1e{decade}</text>')
    for decade in range(math.ceil(y_lo), math.floor(y_hi) + 1):
        parts.append(f'<line x1="66" y1="{py(10.0**decade):.1f}" x2="70" y2="{py(10.0**decade):.1f}" stroke="#333"/>'
                     f'<text x="62" y="{py(10.0**decade) + 3:.1f}" font-size="10" text-anchor="end">1e{decade}</text>')
    for p, xv, yv in zip(points, xs, ys, strict=True):
        share = p.get("bandwidth_share")
        color = "#999" if p.get("above_peak") else "#e45756" if p["bound"] == "memory" and share is not None \
            and share < 0.5 else "#4c78a8"
        parts.append(f'<circle cx="{px(xv):.1f}" cy="{py(yv):.1f}" r="3" fill="{color}" fill-opacity="0.6">'
                     f'<title>{_esc(p["op"])} {_esc(p["shapes"])}: {p["achieved_gbs"]:.1f} GB/s, '
                     f'{xv:.2f} FLOP/B</title></circle>')
    roof = (f"ridge at {ridge:.1f}; roof: {_esc(device['name'])}" if ridge else
            f"roof: {_esc(device['name'])} memory only (FLOP/s unknown)" if bw else
            f"no roof: {_esc(device['name'])}'s peak is unknown")
    parts.append(f'<text x="70" y="{h + 42}" font-size="11">arithmetic intensity (FLOP/byte, log) - {roof}; '
                 'red: memory-bound under half of peak bandwidth; grey: above the peak (not judged)</text>')
    parts.append('<text x="4" y="14" font-size="11">FLOP/s (log)</text></svg>')
    return "".join(parts)


def _legend() -> str:
    items = [*COLORS.items(), ("long gap", "#e45756"), ("short gaps (summed per step)", "#f2a541")]
    return " ".join(f'<span style="display:inline-block;width:10px;height:10px;background:{color}"></span> '
                    f"{_esc(label)}" for label, color in items)


def findings_html(analysis: Analysis) -> str:
    """The findings table: each finding's fix, and the sampled requests it touched, in full."""
    sampled = analysis.summary.get("sampled_request_ids") or []
    rows = []
    for f in analysis.findings:
        touched = f.sampled_request_ids
        others = [r for r in f.request_ids if r not in set(touched)]
        who = (f"{len(touched)} of {len(sampled)} sampled: {_esc(', '.join(touched)) or '-'}" if sampled
               else _esc(", ".join(f.request_ids)) or "-")
        if sampled and others:
            who += f"<br><small>and {len(others)} not sampled: {_esc(', '.join(others))}</small>"
        rows.append(f"<tr><td>{_esc(f.severity)}</td><td>{_esc(f.kind)}</td><td>{f.cost_ms:.2f}</td>"
                    f"<td>{who}</td><td>{_esc(f.title)}<br><b>fix:</b> {_esc(f.fix) or '-'}</td></tr>")
    notes = "".join(f'<p class="warning">warning: {_esc(w)}</p>' for w in analysis.summary.get("warnings") or [])
    table = "".join(rows) or '<tr><td colspan="5">No findings.</td></tr>'
    return (f"{notes}<table><tr><th>severity</th><th>kind</th><th>cost ms</th><th>requests</th>"
            f"<th>what, and what to do</th></tr>{table}</table>")


def body(analysis: Analysis, tokenize_spans: list[tuple[float, float, str]]) -> str:
    s = analysis.summary
    return f"""<p>{_esc(s.get("source"))}: {s.get("events")} events, ranks {_esc(s.get("ranks"))},
{s["steps"]["count"]} model steps ({_esc(s["steps"]["by_kind"])}, from {_esc(", ".join(s["steps"]["source"]))}).</p>
<h2>Utilisation per step</h2>{utilisation_html(s)}
<h2>Findings</h2>
{findings_html(analysis)}
<h2>Timeline: steps, gaps, tokenization</h2>
<p>{_legend()} Hover a bar for its name, length and, for gaps, the cause.</p>{timeline_svg(analysis, tokenize_spans)}
<h2>Gap lengths (inside and between steps)</h2>{histogram_svg(analysis)}
<h2>Roofline of decode ops</h2>{roofline_svg(analysis)}{_bandwidth_notes(analysis)}
{memory_compile_section(s)}
"""


def _bandwidth_notes(analysis: Analysis) -> str:
    bandwidth = analysis.summary.get("bandwidth") or {}
    device = bandwidth.get("device") or {}
    notes = [f"Judged against {_esc(device.get('name'))} ({_esc(device.get('basis'))}: {_esc(device.get('source'))})."]
    above = bandwidth.get("above_peak")
    if isinstance(above, dict):
        notes.append(f"{above.get('ops')} op call(s) above the peak, left out of the findings: "
                     f"{_esc(above.get('error'))} error: {_esc(above.get('why'))}.")
    return "".join(f"<p>{n}</p>" for n in notes) if device else ""


def _page(title: str, content: str) -> str:
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>servprof report: {_esc(title)}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1000px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}}h2{{margin-top:28px}}
.warning{{color:#a15c00}}</style></head>
<body><h1>servprof report</h1>
{content}</body></html>
"""


def render(analysis: Analysis, tokenize_spans: list[tuple[float, float, str]]) -> str:
    return _page(str(analysis.summary.get("source")), body(analysis, tokenize_spans))


def render_sessions(source: str, sessions: list[tuple[str, Analysis | None, list[tuple[float, float, str]]]],
                    what: str | None = None, headings: list[str] | None = None) -> str:
    """Several servprof sessions (or profiler windows) from one folder: one section each, oldest first."""
    what = what or f"{len(sessions)} servprof sessions, each analysed on its own"
    headings = headings or [f"session {label}" for label, _, _ in sessions]
    parts = [f"<p>{_esc(source)}: {_esc(what)}.</p>"]
    for (label, analysis, spans), heading in zip(sessions, headings, strict=True):
        if analysis is not None:
            anchor = re.sub(r"\s+", "-", label)  # (an id holds no spaces)
            parts.append(f'<h1 id="{_esc(anchor)}">{_esc(heading)}</h1>{body(analysis, spans)}')
    return _page(source, "".join(parts))
