"""Baseline speed of the demo LLM server: output tokens/s, TTFT and inter-token latency
at 1, 4 and 16 concurrent streams.

    .venv/bin/python bench/demo_baseline.py                    # tiny model on CPU
    .venv/bin/python bench/demo_baseline.py --size small --json
    .venv/bin/python bench/demo_baseline.py --size 1b --device cuda

Starts `python -m servprof.demo.server` on a free loopback port (servprof off unless
--servprof), drives closed-loop streaming requests with httpx, and prints a rich
table; the last column is throughput relative to 1 stream, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

PROMPT = (
    "The scheduler counted forty small tokens near the station, and the engineer measured "
    "the latency graph after lunch. "
)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [
        sys.executable,
        "-m",
        "servprof.demo.server",
        "--port",
        "0",
        "--size",
        args.size,
        "--device",
        args.device,
        "--max-batch",
        str(max(args.concurrency)),
        "--log-level",
        "info",
    ]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if not args.servprof:
        command.append("--no-servprof")
    command += args.server_arg
    # stdout carries uvicorn's access log: discarded. stderr tells the bound port, then is drained.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    for line in process.stderr:
        match = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line)
        if match:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, match.group(1)
    process.wait()
    raise SystemExit(f"demo server exited ({process.returncode}) before listening")


async def one_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> dict[str, Any]:
    payload = {
        "prompt": PROMPT * 2,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - sent, "itl": np.diff(arrivals).tolist(), "tokens": tokens}


async def run_level(url: str, concurrency: int, requests_per_stream: int, max_tokens: int) -> dict[str, Any]:
    async def worker(client: httpx.AsyncClient) -> list[dict[str, Any]]:
        return [await one_stream(client, url, max_tokens) for _ in range(requests_per_stream)]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_stream(client, url, 4)  # warm-up
        steps_before = (await client.get(f"{url}/demo/stats", params={"steps": 0})).json()["decode_steps"]
        started = time.perf_counter()
        per_worker = await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        stats = (await client.get(f"{url}/demo/stats")).json()
    # The server's own view: how many requests each decode step of this level served.
    level_steps = stats["steps"][-(stats["decode_steps"] - steps_before) :]
    mean_batch = float(np.mean([s["batch_size"] for s in level_steps])) if level_steps else float("nan")
    results = [r for rs in per_worker for r in rs]
    ttft = np.array([r["ttft"] for r in results]) * 1000
    itl = np.array([x for r in results for x in r["itl"]]) * 1000
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "mean_decode_batch": mean_batch,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "itl_ms_p50": float(np.percentile(itl, 50)) if itl.size else float("nan"),
        "itl_ms_p90": float(np.percentile(itl, 90)) if itl.size else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "1b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts (1,4,16)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--servprof", action="store_true", help="keep ServprofMiddleware on in the server")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra demo-server flag (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers (got {args.concurrency!r})")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.requests_per_stream < 1:
        parser.error("--concurrency, --max-tokens and --requests-per-stream must be >= 1")

    process, url = start_server(args)
    try:
        rows = [
            asyncio.run(run_level(url, c, args.requests_per_stream, args.max_tokens))
            for c in args.concurrency
        ]
    finally:
        process.terminate()
        process.wait(30)
    base = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["throughput_vs_first"] = row["output_tokens_per_s"] / base
    if args.json:
        print(
            orjson.dumps(
                {"size": args.size, "device": args.device, "max_tokens": args.max_tokens, "rows": rows},
                option=orjson.OPT_INDENT_2,
            ).decode()
        )
        return 0
    table = Table(
        title=f"demo server baseline: size={args.size} device={args.device} max_tokens={args.max_tokens}"
    )
    for column in (
        "streams",
        "reqs",
        "mean batch",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "ITL p50 ms",
        "ITL p90 ms",
        f"tok/s vs {args.concurrency[0]}",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["concurrency"]),
            str(row["requests"]),
            f"{row['mean_decode_batch']:.1f}",
            f"{row['output_tokens_per_s']:.0f}",
            f"{row['ttft_ms_p50']:.1f}",
            f"{row['ttft_ms_p90']:.1f}",
            f"{row['itl_ms_p50']:.2f}",
            f"{row['itl_ms_p90']:.2f}",
            f"{row['throughput_vs_first']:.2f}x",
        )
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
