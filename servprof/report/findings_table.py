"""The findings table, one for every place that prints findings (`servprof analyze`, `servprof demo`).

Input is the report's JSON form (summary dict, Finding.to_dict() list), so a report read back
from disk prints the same as one just computed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from servprof.detect.cause_texts import CAUSES

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def requests_cell(finding: dict[str, Any], sampled: list[str]) -> str:
    """How many of the session's sampled requests a finding touched (and how many others it names)."""
    ids = [r for r in finding.get("request_ids") or [] if isinstance(r, str)]
    if not sampled:
        return str(len(ids)) if ids else "-"
    touched = finding.get("sampled_request_ids")
    touched = [r for r in touched if isinstance(r, str)] if isinstance(touched, list) else \
        [r for r in ids if r in set(sampled)]
    if not ids:
        return "session"
    cell = f"{len(touched)} of {len(sampled)}"
    others = len(ids) - len(touched)
    return cell + (f" (+{others} not sampled)" if others else "")


# Findings of one kind, severity and fix (per-request tokenization stalls on a busy server): the
# first few in full, the rest in one row; the JSON report keeps every one.
SHOWN_ALIKE = 2


def findings_table(findings: list[dict[str, Any]], sampled: list[str], title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("cost ms", justify="right", no_wrap=True)
    table.add_column("sampled requests" if sampled else "requests", max_width=16)
    table.add_column("finding, and what to do", ratio=1, min_width=30)
    # Text cells, not markup strings: rich parses a markup string each time it measures or renders a
    # cell (twice per table), and the findings' own text then needs no escaping.
    alike: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for finding in findings:
        alike.setdefault(_alike_key(finding), []).append(finding)
    placed: dict[tuple[str, str, str], int] = {}
    for finding in findings:
        key = _alike_key(finding)
        group, place = alike[key], placed.get(key, 0)
        placed[key] = place + 1
        collapsed = len(group) > SHOWN_ALIKE + 1  # (one row for a single one more would save nothing)
        if collapsed and place > SHOWN_ALIKE:
            continue
        if collapsed and place == SHOWN_ALIKE:
            rest = group[SHOWN_ALIKE:]
            costs = [float(f["cost_ms"]) for f in rest if isinstance(f.get("cost_ms"), int | float)]
            _add_row(table, finding, _more_alike(rest, costs), f"{len(rest)} more", sum(costs) if costs else None)
            continue
        text = Text(str(finding.get("title", "")))
        if finding.get("fix"):
            text.append("\n")
            text.append("fix:", "dim")
            text.append(" as above" if place else f" {finding['fix']}")
        cost = finding.get("cost_ms")
        _add_row(table, finding, text, requests_cell(finding, sampled), cost if isinstance(cost, int | float) else None)
    return table


def _alike_key(finding: dict[str, Any]) -> tuple[str, str, str]:
    return str(finding.get("kind")), str(finding.get("severity")), str(finding.get("fix"))


def _more_alike(rest: list[dict[str, Any]], costs: list[float]) -> Text:
    spread = f" (cost {min(costs):.2f}-{max(costs):.2f} ms each, {sum(costs):.2f} ms in all)" if costs else ""
    return Text(f"and {len(rest)} more like the ones above{spread}, same fix: every one is in the JSON report "
                "(--json)", "dim")


def _add_row(table: Table, finding: dict[str, Any], text: Text, requests: str, cost: float | None) -> None:
    severity = str(finding.get("severity", "info"))
    table.add_row(Text.assemble((severity, SEVERITY_STYLE.get(severity, ""))), Text(str(finding.get("kind", "?"))),
                  Text(f"{cost:.2f}" if cost is not None else ""), Text(requests), text)


def findings_renderables(summary: dict[str, Any], findings: list[dict[str, Any]],
                         title: str | None = None) -> list[RenderableType]:
    """Warnings, what the trace could not show, and the findings table (or why there is none)."""
    out: list[RenderableType] = []
    lines = Text()
    for warning in summary.get("warnings") or []:
        lines.append_tokens((("warning:", "yellow"), (f" {warning}\n", "")))
    sampled = [r for r in summary.get("sampled_request_ids") or [] if isinstance(r, str)]
    missing = [m for m in summary.get("missing") or [] if isinstance(m, dict) and m.get("message")]
    if not findings:
        lines.append("No findings: no tokenization stall, decode gap or bandwidth-bound decode op stood out"
                     + (" in what this trace could show:\n" if missing else ".\n"))
    for item in missing:
        lines.append_tokens((("  ", ""), (f"{item.get('what', '')}:", "dim"), (f" {item['message']}\n", "")))
    if not findings:
        for text in below_bar_lines(summary):
            lines.append_tokens((("  ", ""), ("under the bar:", "dim"), (f" {text}\n", "")))
    if lines:
        lines.rstrip()  # the renderable's own end closes the last line
        out.append(lines)
    if findings:
        out.append(findings_table(findings, sampled, title))
    return out


def below_bar_lines(summary: dict[str, Any], limit: int = 3) -> list[str]:
    """The gaps seen but too small to report, largest first: what a finding-less trace did show."""
    seen = [b for b in (summary.get("decode_gap") or {}).get("below_bar") or [] if isinstance(b, dict)]
    out = []
    for item in sorted(seen, key=lambda b: -float(b.get("ms") or 0.0))[:limit]:
        where = "between" if item.get("where") == "between_steps" else "inside"
        label = CAUSES.get(str(item.get("cause")), (str(item.get("cause")),))[0]
        single = item.get("gaps") == 1
        out.append(f"{item.get('gaps')} gap(s) {where} {item.get('steps')}, {float(item.get('ms') or 0):.2f} ms "
                   f"({float(item.get('share') or 0):.0%} of step time; {'one gap is' if single else 'gaps are'} reported "
                   f"from {float(item.get('bar') or 0):.0%}): {label}")
    return out


def print_findings(console: Console, summary: dict[str, Any], findings: list[dict[str, Any]],
                   title: str | None = None) -> None:
    console.print(Group(*findings_renderables(summary, findings, title)))
