"""A self-contained HTML report: findings, a timeline of steps and gaps, a gap
histogram and a roofline plot, drawn as inline SVG (no scripts, nothing fetched)."""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

from servprof.detect.analysis import Analysis
from servprof.report.memory_compile import html_section as memory_compile_section

WIDTH, LANE = 960, 18
MAX_TIMELINE_STEPS = 3000
MAX_ROOFLINE_POINTS = 2000
COLORS = {"decode": "#4c78a8", "prefill": "#72b7b2", "mixed": "#54a24b", "step": "#9d755d", "tokenize": "#f58518"}


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def timeline_svg(analysis: Analysis, tokenize_spans: list[tuple[float, float, str]]) -> str:
    steps = analysis.steps[:MAX_TIMELINE_STEPS]
    if not steps:
        return "<p>No model steps were found in this trace, so there is no timeline.</p>"
    t0 = min(s.start_us for s in steps)
    t1 = max(s.end_us for s in steps)
    for start, end, _ in tokenize_spans:
        t0, t1 = min(t0, start), max(t1, end)
    scale = (WIDTH - 120) / max(t1 - t0, 1.0)

    def x(t: float) -> float:
        return 110 + (t - t0) * scale

    lanes = {"steps": 20, "gaps": 20 + LANE + 6, "tokenize": 20 + 2 * (LANE + 6)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{lanes["tokenize"] + LANE + 30}">']
    for label, y in lanes.items():
        parts.append(f'<text x="4" y="{y + 13}" font-size="12">{label}</text>')
    for s in steps:
        w = max((s.end_us - s.start_us) * scale, 0.5)
        parts.append(f'<rect x="{x(s.start_us):.1f}" y="{lanes["steps"]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="{COLORS.get(s.kind, "#888")}"><title>{_esc(s.kind)} {_esc(s.label[:80])} '
                     f'{s.dur_us / 1000:.2f} ms</title></rect>')
    for g in analysis.gaps:
        w = max((g.end_us - g.start_us) * scale, 1.0)
        parts.append(f'<rect x="{x(g.start_us):.1f}" y="{lanes["gaps"]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="#e45756"><title>{g.idle_us / 1000:.2f} ms idle: {_esc(g.explanation)}</title></rect>')
    for start, end, rid in tokenize_spans:
        w = max((end - start) * scale, 0.5)
        parts.append(f'<rect x="{x(start):.1f}" y="{lanes["tokenize"]}" width="{w:.1f}" height="{LANE}" '
                     f'fill="{COLORS["tokenize"]}"><title>tokenize {_esc(rid)} {(end - start) / 1000:.2f} ms</title></rect>')
    axis_y = lanes["tokenize"] + LANE + 16
    parts.append(f'<text x="110" y="{axis_y}" font-size="11">0 ms</text>')
    parts.append(f'<text x="{WIDTH - 10}" y="{axis_y}" font-size="11" text-anchor="end">{(t1 - t0) / 1000:.1f} ms</text>')
    parts.append("</svg>")
    return "".join(parts)


def histogram_svg(analysis: Analysis) -> str:
    by_thread: dict[tuple[int, int], list[Any]] = {}
    for s in analysis.steps:
        by_thread.setdefault((s.rank, s.tid), []).append(s)
    gaps = [(b.start_us - a.end_us) / 1000 for steps in by_thread.values() for a, b in zip(steps, steps[1:], strict=False)
            if b.start_us >= a.end_us]
    if not gaps:
        return "<p>Fewer than two steps on one thread: no gaps between steps to plot.</p>"
    counts, edges = np.histogram(np.array(gaps), bins=min(30, max(5, len(gaps) // 3)))
    height, top = 200, max(int(counts.max()), 1)
    bar_w = (WIDTH - 80) / len(counts)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height + 40}">']
    for i, c in enumerate(counts.tolist()):
        h = c / top * height
        parts.append(f'<rect x="{60 + i * bar_w:.1f}" y="{10 + height - h:.1f}" width="{bar_w - 1:.1f}" height="{h:.1f}" '
                     f'fill="#4c78a8"><title>{edges[i]:.2f}-{edges[i + 1]:.2f} ms: {c}</title></rect>')
    parts.append(f'<text x="60" y="{height + 28}" font-size="11">{edges[0]:.2f} ms</text>')
    parts.append(f'<text x="{WIDTH - 20}" y="{height + 28}" font-size="11" text-anchor="end">{edges[-1]:.2f} ms</text>')
    parts.append(f'<text x="4" y="20" font-size="11">{top}</text></svg>')
    return "".join(parts)


def roofline_svg(analysis: Analysis) -> str:
    points = [p for p in analysis.kernels if p["flops"] > 0 and p["time_us"] > 0][:MAX_ROOFLINE_POINTS]
    device = analysis.summary.get("bandwidth", {}).get("device", {})
    if not points or not device:
        return "<p>No decode op with record_shapes: nothing to place on the roofline.</p>"
    bw, peak = device["memory_bandwidth_gbs"] * 1e9, device["peak_tflops"] * 1e12
    xs = [p["intensity"] for p in points]
    ys = [p["achieved_tflops"] * 1e12 for p in points]
    x_lo, x_hi = math.log10(min(xs) / 2), math.log10(max(max(xs), peak / bw) * 4)
    y_lo, y_hi = math.log10(max(min(ys) / 2, 1.0)), math.log10(peak * 2)
    w, h = WIDTH - 100, 320

    def px(v: float) -> float:
        return 70 + (math.log10(v) - x_lo) / (x_hi - x_lo) * w

    def py(v: float) -> float:
        return 10 + h - (math.log10(max(v, 1e-30)) - y_lo) / (y_hi - y_lo) * h

    ridge = peak / bw
    left, right = 10**x_lo, 10**x_hi
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h + 55}">',
             f'<polyline fill="none" stroke="#333" stroke-width="2" points="{px(left):.1f},{py(bw * left):.1f} '
             f'{px(ridge):.1f},{py(peak):.1f} {px(right):.1f},{py(peak):.1f}"/>']
    # Decade ticks on both log axes.
    for decade in range(math.ceil(x_lo), math.floor(x_hi) + 1):
        parts.append(f'<line x1="{px(10.0**decade):.1f}" y1="{10 + h}" x2="{px(10.0**decade):.1f}" y2="{14 + h}" '
                     f'stroke="#333"/><text x="{px(10.0**decade):.1f}" y="{h + 25}" font-size="10" '
                     f'text-anchor="middle">1e{decade}</text>')
    for decade in range(math.ceil(y_lo), math.floor(y_hi) + 1):
        parts.append(f'<line x1="66" y1="{py(10.0**decade):.1f}" x2="70" y2="{py(10.0**decade):.1f}" stroke="#333"/>'
                     f'<text x="62" y="{py(10.0**decade) + 3:.1f}" font-size="10" text-anchor="end">1e{decade}</text>')
    for p, xv, yv in zip(points, xs, ys, strict=True):
        color = "#e45756" if p["bound"] == "memory" and p["bandwidth_share"] < 0.5 else "#4c78a8"
        parts.append(f'<circle cx="{px(xv):.1f}" cy="{py(yv):.1f}" r="3" fill="{color}" fill-opacity="0.6">'
                     f'<title>{_esc(p["op"])} {_esc(p["shapes"])}: {p["achieved_gbs"]:.1f} GB/s, '
                     f'{xv:.2f} FLOP/B</title></circle>')
    parts.append(f'<text x="70" y="{h + 42}" font-size="11">arithmetic intensity (FLOP/byte, log) - ridge at {ridge:.1f}; '
                 f'roof: {_esc(device["name"])}; red: memory-bound under half of peak bandwidth</text>')
    parts.append('<text x="4" y="14" font-size="11">FLOP/s (log)</text></svg>')
    return "".join(parts)


def _legend() -> str:
    items = [*COLORS.items(), ("reported gap", "#e45756")]
    return " ".join(f'<span style="display:inline-block;width:10px;height:10px;background:{color}"></span> '
                    f"{_esc(label)}" for label, color in items)


def render(analysis: Analysis, tokenize_spans: list[tuple[float, float, str]]) -> str:
    rows = "".join(
        f"<tr><td>{_esc(f.severity)}</td><td>{_esc(f.kind)}</td><td>{f.cost_ms:.2f}</td>"
        f"<td>{_esc(', '.join(f.request_ids[:5]))}</td><td>{_esc(f.title)}</td></tr>"
        for f in analysis.findings
    ) or '<tr><td colspan="5">No findings.</td></tr>'
    s = analysis.summary
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>servprof report: {_esc(s.get("source"))}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1000px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}}h2{{margin-top:28px}}</style></head>
<body><h1>servprof report</h1>
<p>{_esc(s.get("source"))}: {s.get("events")} events, ranks {_esc(s.get("ranks"))},
{s["steps"]["count"]} model steps ({_esc(s["steps"]["by_kind"])}, from {_esc(", ".join(s["steps"]["source"]))}).</p>
<h2>Findings</h2>
<table><tr><th>severity</th><th>kind</th><th>cost ms</th><th>requests</th><th>what</th></tr>{rows}</table>
<h2>Timeline: steps, gaps, tokenization</h2>
<p>{_legend()} Hover a bar for its name, length and, for gaps, the cause.</p>{timeline_svg(analysis, tokenize_spans)}
<h2>Gaps between consecutive steps</h2>{histogram_svg(analysis)}
<h2>Roofline of decode ops</h2>{roofline_svg(analysis)}
{memory_compile_section(s)}
</body></html>
"""
