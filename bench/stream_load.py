"""A small closed-loop streaming load for the unmarked test servers (tests/servers) and the demo
server, run in its own process so that the client's work does not share the server's GIL.

Each of ``--users`` clients posts ``/v1/completions`` (``"stream": true``, which OpenAI-style
servers such as the demo need) and reads the SSE stream to the end, again and again. Every
streamed text event (a ``data: {...}`` line other than a usage one) is counted in 100 ms bins of
wall-clock time; the bins are written as JSON at the end, so a benchmark can compare stream
rates over any window it measured. ``start()`` / ``stop()`` run it from a benchmark.

    python bench/stream_load.py http://127.0.0.1:8000 --users 4 --seconds 60 --out load.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson

BIN_S = 0.1
PROSE = ("The harbour master counted the boats twice before the storm, and the baker sold warm bread to the "
         "sailors at dawn while the old clock on the pier kept its own slow time. ")


async def user(client: httpx.AsyncClient, url: str, body: dict[str, object], deadline: float,
               bins: Counter[int], counts: Counter[str]) -> None:
    while time.time() < deadline:
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and not line.startswith('data: {"usage"'):
                        bins[int(time.time() / BIN_S)] += 1
            counts["requests"] += 1
        except httpx.HTTPError:
            counts["errors"] += 1
            await asyncio.sleep(0.1)


def write(path: str, bins: Counter[int], counts: Counter[str]) -> None:
    with open(path, "wb") as file:
        file.write(orjson.dumps({"bin_s": BIN_S, "bins": {str(k): v for k, v in sorted(bins.items())}, **counts}))


async def run(args: argparse.Namespace) -> None:
    bins: Counter[int] = Counter()
    counts: Counter[str] = Counter()

    def terminated() -> None:  # the benchmark stops the load when it has measured enough
        write(args.out, bins, counts)
        os._exit(0)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminated)
    deadline = time.time() + args.seconds
    prompt = (PROSE * (args.prompt_chars // len(PROSE) + 1))[: args.prompt_chars]
    body: dict[str, object] = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.users + 4)) as client:
        await asyncio.gather(*(user(client, args.url, body, deadline, bins, counts)
                               for _ in range(args.users)))
    write(args.out, bins, counts)


def start(url: str, out: Path, users: int, seconds: float, max_tokens: int, ignore_eos: bool = False
          ) -> subprocess.Popen[bytes]:
    """This load in its own process, for a benchmark: stop it with stop()."""
    command = [sys.executable, __file__, url, "--users", str(users), "--seconds", str(seconds),
               "--max-tokens", str(max_tokens), "--out", str(out)]
    return subprocess.Popen(command + (["--ignore-eos"] if ignore_eos else []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(process: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    """Stop a load start() began; its result: ``bins`` (stream events per ``bin_s`` of wall clock,
    keyed by the bin's index as text), ``requests``, ``errors``."""
    process.terminate()
    process.wait(60)
    return orjson.loads(out.read_bytes()) if out.exists() else {"bins": {}, "bin_s": BIN_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--ignore-eos", action="store_true", help="ask for max_tokens whatever the model says (vLLM's "
                        "extension, the demo server's too)")
    parser.add_argument("--out", required=True)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
