"""What `servprof demo` leaves under --out: one line per artifact, where it is or why it is missing,
and the same list as demo.json for tools."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console


@dataclass
class Artifacts:
    out: Path
    notes: dict[str, str] = field(default_factory=dict)  # artifact -> why it is missing

    @property
    def paths(self) -> dict[str, Path]:
        return {
            "report HTML": self.out / "report.html",
            "report JSON": self.out / "report.json",
            "findings (live analysis)": self.out / "analysis.json",
            "traces": self.out / "traces",
            "spans": self.out / "spans" / "spans.otlp.jsonl",
            "locust CSVs": self.out / "locust" / "locust_stats.csv",
            "harness summary": self.out / "harness-summary.json",
            "per-request timings": self.out / "harness-requests.jsonl",
            "logs": self.out / "logs",
        }

    def present(self, name: str) -> bool:
        path = self.paths[name]
        return path.is_dir() and any(path.iterdir()) if path.is_dir() else path.is_file() and path.stat().st_size > 0


def print_artifacts(console: Console, artifacts: Artifacts) -> bool:
    """One line per artifact (never wrapped, so paths stay copyable); False if any is missing."""
    console.print(f"[bold]servprof demo: artifacts in {artifacts.out}[/]", soft_wrap=True)
    width = max(len(name) for name in artifacts.paths)
    all_there = True
    manifest: dict[str, dict[str, Any]] = {}
    for name, path in artifacts.paths.items():
        entry: dict[str, Any] = {"path": str(path), "present": artifacts.present(name)}
        if entry["present"]:
            where = str(path)
        elif name == "spans" and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            where = entry["sent_to"] = f"sent to {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']} (OTLP)"
        else:
            all_there = False
            entry["missing_because"] = artifacts.notes.get(name, "not produced")
            where = f"[red]missing[/]: {entry['missing_because']}"
        manifest[name] = entry
        console.print(f"  {name:<{width}}  {where}", soft_wrap=True, highlight=False)
    # The same list for tools: which artifact is where, or why it is missing.
    (artifacts.out / "demo.json").write_bytes(orjson.dumps({"complete": all_there, "artifacts": manifest},
                                                              option=orjson.OPT_INDENT_2))
    return all_there
