"""Per-request samples, kept unrounded, and the end-of-run summary.

Locust rounds the response times it keeps (whole ms under 100 ms), which erases
sub-millisecond inter-token latencies, so the harness keeps its own samples in seconds
as floats. Workers send theirs to the master with each stats report; the master merges
them and writes the summary. Metric definitions follow `vllm bench serve`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2el_ms", "e2el": "e2el_ms"}
# Columns of one request row, in the order the collector stores them.
REQUEST_FIELDS = ("send_unix_s", "end_unix_s", "ttft_s", "e2el_s", "tpot_s", "output_tokens", "input_tokens")


class SLOError(ValueError):
    """A --slo value servprof cannot read."""


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=MS,tpot=MS,e2e=MS` (any subset) -> {"ttft_ms": .., ...}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise SLOError(f"--slo: cannot read {part!r}; expected ttft=MS,tpot=MS,e2e=MS")
        try:
            milliseconds = float(value)
        except ValueError:
            raise SLOError(f"--slo: {key}={value!r} is not a number of milliseconds") from None
        if not math.isfinite(milliseconds) or milliseconds <= 0:
            raise SLOError(f"--slo: {key} must be a positive number of milliseconds, got {value}")
        slo[SLO_KEYS[key]] = milliseconds
    return slo


@dataclass
class Collector:
    """Samples of one process (or, on the master, of all workers merged)."""

    requests: list[list[float]] = field(default_factory=list)  # REQUEST_FIELDS per request
    request_ids: list[str] = field(default_factory=list)  # parallel to requests
    itl_s: list[float] = field(default_factory=list)
    arrival_lag_s: list[float] = field(default_factory=list)  # open loop: start minus due time
    failures: int = 0
    sources: set[str] = field(default_factory=set)  # worker ids merged into this one
    _sent: int = 0
    _sent_itl: int = 0
    _sent_lag: int = 0
    _sent_failures: int = 0

    def add_request(self, row: list[float], itl_s: list[float], request_id: str = "") -> None:
        self.requests.append(row)
        self.request_ids.append(request_id)
        self.itl_s.extend(itl_s)

    def drain(self) -> dict[str, Any]:
        """What is new since the last drain, as plain lists (locust's messages are msgpack)."""
        data = {
            "requests": self.requests[self._sent :],
            "request_ids": self.request_ids[self._sent :],
            "itl_s": self.itl_s[self._sent_itl :],
            "arrival_lag_s": self.arrival_lag_s[self._sent_lag :],
            "failures": self.failures - self._sent_failures,
        }
        self._sent, self._sent_itl = len(self.requests), len(self.itl_s)
        self._sent_lag, self._sent_failures = len(self.arrival_lag_s), self.failures
        return data

    def merge(self, data: dict[str, Any], source: str) -> None:
        rows = [list(row) for row in data.get("requests", [])]
        self.requests.extend(rows)
        self.request_ids.extend(data.get("request_ids") or [""] * len(rows))
        self.itl_s.extend(data.get("itl_s", []))
        self.arrival_lag_s.extend(data.get("arrival_lag_s", []))
        self.failures += int(data.get("failures", 0))
        self.sources.add(source)


def _stats(values: np.ndarray, scale: float = 1000.0) -> dict[str, float | int | None]:
    values = values[np.isfinite(values)] * scale
    if not len(values):
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    result: dict[str, float | int | None] = {"count": int(len(values)), "mean": float(values.mean())}
    for p, value in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True):
        result[f"p{p}"] = float(value)
    return result


def summarize(collector: Collector, slo: dict[str, float], options: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = np.array(collector.requests, dtype=np.float64).reshape(-1, len(REQUEST_FIELDS))
    columns = {name: rows[:, i] for i, name in enumerate(REQUEST_FIELDS)}
    completed = len(rows)
    duration = float(columns["end_unix_s"].max() - columns["send_unix_s"].min()) if completed else 0.0
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    output_tokens = float(columns["output_tokens"].sum())
    input_tokens = float(np.nansum(columns["input_tokens"]))
    metrics = {
        "ttft_ms": _stats(columns["ttft_s"]),
        "tpot_ms": _stats(columns["tpot_s"]),
        "itl_ms": _stats(np.array(collector.itl_s, dtype=np.float64)),
        "e2el_ms": _stats(columns["e2el_s"]),
        "output_tokens": _stats(columns["output_tokens"], scale=1.0),
    }
    good = np.ones(completed, dtype=bool)
    for key, limit_ms in slo.items():
        column = {"ttft_ms": "ttft_s", "tpot_ms": "tpot_s", "e2el_ms": "e2el_s"}[key]
        values = columns[column] * 1000.0
        # A request with no value for a metric (one output token has no TPOT) passes that SLO.
        good &= ~(values > limit_ms)
    lags = np.array(collector.arrival_lag_s, dtype=np.float64)
    return {
        "completed": completed,
        "failed": collector.failures,
        "duration_s": duration,
        "request_throughput_rps": per_second(completed),
        "output_token_throughput_tps": per_second(output_tokens),
        "total_token_throughput_tps": per_second(output_tokens + input_tokens),
        "total_output_tokens": int(output_tokens),
        "total_input_tokens": int(input_tokens),
        "slo": slo,
        "good_requests": int(good.sum()) if slo else None,
        "goodput_rps": per_second(float(good.sum())) if slo else None,
        "metrics": metrics,
        "arrivals": {
            "count": int(len(lags)),
            "late_over_100ms": int((lags > 0.1).sum()),
            "lag_ms": _stats(lags),
        },
        "workers": sorted(collector.sources),
        "options": options or {},
    }


def write_summary_json(summary: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def write_requests_jsonl(collector: Collector, path: str | Path) -> Path:
    """One JSON line per completed request: its id and its REQUEST_FIELDS (seconds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        for request_id, row in zip(collector.request_ids, collector.requests, strict=True):
            record = {"request_id": request_id, **dict(zip(REQUEST_FIELDS, row, strict=True))}
            record = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}
            handle.write(orjson.dumps(record) + b"\n")
    return path


def summary_table(summary: dict[str, Any]) -> Any:
    """The summary as a rich renderable (a table of metrics, with throughput in the caption)."""
    from rich.table import Table

    def fmt(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    table = Table(title="servprof harness summary", title_justify="left")
    table.add_column("metric")
    for column in ("count", "mean", *(f"p{p}" for p in PERCENTILES)):
        table.add_column(column, justify="right")
    for name, stats in summary["metrics"].items():
        digits = 0 if name == "output_tokens" else 3
        table.add_row(
            name, str(stats["count"]), fmt(stats["mean"], digits), *(fmt(stats[f"p{p}"], digits) for p in PERCENTILES)
        )
    lines = [
        f"completed {summary['completed']}, failed {summary['failed']} in {summary['duration_s']:.1f} s",
        f"requests/s {summary['request_throughput_rps']:.2f}, output tokens/s "
        f"{summary['output_token_throughput_tps']:.1f}, total tokens/s {summary['total_token_throughput_tps']:.1f}",
    ]
    if summary["slo"]:
        slo = ", ".join(f"{k}<={v:g}" for k, v in summary["slo"].items())
        lines.append(f"goodput {summary['goodput_rps']:.2f} req/s ({summary['good_requests']} met {slo})")
    arrivals = summary["arrivals"]
    if arrivals["count"]:
        lines.append(
            f"open-loop arrivals {arrivals['count']}, {arrivals['late_over_100ms']} started >100 ms late "
            f"(lag p99 {fmt(arrivals['lag_ms']['p99'])} ms): add users (-u) if many are late"
        )
    table.caption = "\n".join(lines)
    table.caption_justify = "left"
    return table
