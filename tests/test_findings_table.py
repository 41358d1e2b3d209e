"""The terminal findings table: many findings alike (one per request, one fix) print as the first
few in full and one row for the rest, which says how many and what they cost; the JSON report
keeps each of them."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from servprof.report.findings_table import SHOWN_ALIKE, findings_table

FIX = "Tokenize in a pool off the request's critical path."


def _stall(i: int, cost: float) -> dict[str, Any]:
    return {"kind": "tokenization_stall", "severity": "warning", "cost_ms": cost, "fix": FIX,
            "title": f"request r{i} spent {cost:.1f} ms tokenizing", "request_ids": [f"r{i}"]}


def _printed(findings: list[dict[str, Any]]) -> str:
    console = Console(record=True, width=400)
    console.print(findings_table(findings, []))
    return console.export_text()


def test_many_alike_findings_print_the_first_few_and_one_row_for_the_rest() -> None:
    stalls = [_stall(i, cost) for i, cost in enumerate([12.0, 11.0, 9.0, 8.0, 7.0, 6.0])]
    other = {"kind": "decode_gap", "severity": "critical", "cost_ms": 40.0, "fix": "Fuse the kernels.",
             "title": "gaps between decode steps", "request_ids": []}
    printed = _printed([other, *stalls])
    for shown in stalls[:SHOWN_ALIKE]:
        assert shown["title"] in printed
    for folded in stalls[SHOWN_ALIKE:]:
        assert folded["title"] not in printed
    assert printed.count(FIX) == 1 and printed.count("fix: as above") == SHOWN_ALIKE - 1
    rest = stalls[SHOWN_ALIKE:]
    assert (f"and {len(rest)} more like the ones above (cost 6.00-9.00 ms each, "
            f"{sum(f['cost_ms'] for f in rest):.2f} ms in all)") in printed
    assert f"{len(rest)} more" in printed and "gaps between decode steps" in printed and "Fuse the kernels." in printed


def test_one_more_alike_finding_is_printed_not_folded() -> None:
    stalls = [_stall(i, 10.0 - i) for i in range(SHOWN_ALIKE + 1)]
    printed = _printed(stalls)
    assert all(f["title"] in printed for f in stalls) and "more like the ones above" not in printed
