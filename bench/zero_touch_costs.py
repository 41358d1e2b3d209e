"""What zero-touch costs: the automatic phases and the loop watchdog, per request, with no
session running and with one (part of bench/bench_zero_touch.py; runs alone too).

CPU time of the thread doing the work, medians of interleaved rounds, so that a shared
machine's waits for a CPU do not count. The hooks' cost does not depend on what a model
computes, so it is measured on models that compute next to nothing.

    .venv/bin/python bench/zero_touch_costs.py
"""

from __future__ import annotations

import asyncio
import importlib
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test servers: servers.hf_streaming, servers.handwritten_loop
SERVERS = {"hf": "servers.hf_streaming", "loop": "servers.handwritten_loop"}


def _us_per_call(fn: Any, n: int) -> float:
    """CPU time of this thread per call: a shared machine's waits for a CPU do not count (what
    is measured here is work done, which runs in the calling thread)."""
    start = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - start) / n / 1e3


def _paired(block_a: Any, block_b: Any, rounds: int = 9) -> tuple[float, float]:
    """(median of A, median of B - A) over interleaved rounds: a shared machine's drift hits
    both alike. Each block returns µs per call and sets up what it needs itself."""
    block_a(), block_b()  # warm both
    base, diffs = [], []
    for _ in range(rounds):
        a = block_a()
        b = block_b()
        base.append(a)
        diffs.append(b - a)
    return statistics.median(base), statistics.median(diffs)


def measure_costs() -> dict[str, float]:
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from servprof.auto import AutoInstrumentation, steps
    from servprof.auto.context import install_thread_inheritance, remove_thread_inheritance
    from servprof.sampling import Sampler
    from servprof.settings import Settings

    costs: dict[str, float] = {}
    # One intra-op thread: on a shared machine a parallel region waits for a busy core, and that
    # noise (tens of ms) would drown the µs measured here. The hooks' cost is Python-side anyway.
    torch.set_num_threads(1)

    def start_thread() -> None:
        thread = threading.Thread(target=int)
        thread.start()
        thread.join()

    def threads(patched: bool) -> Any:
        def block() -> float:
            (install_thread_inheritance if patched else remove_thread_inheritance)()
            return _us_per_call(start_thread, 200)
        return block

    costs["thread_start_us"], costs["thread_start_patch_us"] = _paired(threads(False), threads(True))
    install_thread_inheritance()
    sampling, idle = Sampler(Settings(sample_every=10**9)), Sampler(Settings())
    _, costs["route_filter_us"] = _paired(
        lambda: _us_per_call(lambda: idle.decide(False, None, "POST", "/v1/completions"), 20000),
        lambda: _us_per_call(lambda: sampling.decide(False, None, "POST", "/v1/completions"), 20000))
    hf = importlib.import_module(SERVERS["hf"])
    loop = importlib.import_module(SERVERS["loop"])
    auto = AutoInstrumentation()

    def stepping(step: Any, hooks: str, n: int = 300) -> Any:
        def block() -> float:
            if hooks == "none":
                return _us_per_call(step, n)
            saved = steps.DISCOVERY_STEPS, steps.MAX_DISCOVERY_STEPS
            if hooks == "global":  # global hooks on every module call, as while discovering
                steps.DISCOVERY_STEPS = steps.MAX_DISCOVERY_STEPS = 10**9
            auto.start(list, None)
            if hooks == "model":
                for _ in range(steps.DISCOVERY_STEPS + 1):  # past discovery: hooks on the model only
                    step()
            try:
                return _us_per_call(step, n)
            finally:
                auto.stop()
                auto.remove()
                steps.DISCOVERY_STEPS, steps.MAX_DISCOVERY_STEPS = saved
        return block

    # The hooks' cost does not depend on what a step computes: measured on models that compute
    # next to nothing (one Linear(1, 1); then 32 modules), so that it stands out of the noise.
    tiny = torch.nn.Sequential(torch.nn.Linear(1, 1)).eval()
    wide = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(31)], torch.nn.Linear(1, 1)).eval()
    one = torch.ones(1, 1)
    prof = profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
    with torch.inference_mode():
        for name, model in (("hf", hf.model), ("loop", loop.model)):
            ids = torch.ones(1, 1, dtype=torch.long)
            costs[f"{name}_step_us"] = _us_per_call(lambda m=model, i=ids: m(i), 20)
            auto.start(list, None)
            for _ in range(3):
                model(ids)
            costs[f"{name}_module_calls_per_step"] = auto.steps.module_calls / max(1, auto.steps.steps)
            auto.stop()
            auto.remove()
        prof.start()
        on, costs["hooks_per_step_us"] = _paired(stepping(lambda: tiny(one), "none"),
                                                 stepping(lambda: tiny(one), "model"))
        wide_on, wide_global = _paired(stepping(lambda: wide(one), "none"), stepping(lambda: wide(one), "global"))
        prof.stop()
        costs["global_hooks_per_call_us"] = wide_global / 32
        for name, model in (("hf", hf.model), ("loop", loop.model)):
            ids = torch.ones(1, 1, dtype=torch.long)
            bare = _us_per_call(lambda m=model, i=ids: m(i), 20)
            prof.start()
            costs[f"{name}_profiler_per_step_us"] = _us_per_call(lambda m=model, i=ids: m(i), 20) - bare
            prof.stop()
        text = "The harbour master counted the boats twice before the storm. " * 4

        def encoding(patched: bool) -> Any:
            def block() -> float:
                if patched:
                    auto.start(list, None)
                try:
                    return _us_per_call(lambda: loop.tokenizer.encode(text), 1000)
                finally:
                    if patched:
                        auto.stop()
                        auto.remove()
            return block

        prof.start()
        costs["tokenize_call_us"], costs["tokenizer_patch_per_call_us"] = _paired(encoding(False), encoding(True))
        prof.stop()
    costs.update(_watchdog_cost())
    return costs


def _watchdog_cost(seconds: float = 1.0, handlers: int = 3000, work_us: float = 200.0) -> dict[str, float]:
    """CPU the watchdog takes while a session runs: on a busy loop (200 µs handlers back to back:
    the share of loop CPU its heartbeats add), and per second on an idle loop and on its thread."""
    from servprof.watchdog import LoopWatchdog

    def handler() -> None:
        end = time.perf_counter() + work_us / 1e6
        while time.perf_counter() < end:
            pass

    async def busy(with_watchdog: bool) -> float:
        watchdog = LoopWatchdog(10.0) if with_watchdog else None
        if watchdog is not None:
            watchdog.attach()
        start = time.thread_time_ns()
        for _ in range(handlers):
            handler()
            await asyncio.sleep(0)
        cpu = (time.thread_time_ns() - start) / handlers / 1e3
        if watchdog is not None:
            watchdog.stop()
        return cpu  # µs of loop CPU per handler

    async def idle(with_watchdog: bool) -> tuple[float, float]:
        watchdog = LoopWatchdog(10.0) if with_watchdog else None
        if watchdog is not None:
            watchdog.attach()
        start = time.thread_time_ns()
        await asyncio.sleep(seconds)
        loop_cpu = (time.thread_time_ns() - start) / seconds / 1e3
        thread_cpu = 0.0
        if watchdog is not None:
            thread = watchdog._thread
            assert thread is not None and thread.ident is not None
            thread_cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) * 1e6 / seconds
            watchdog.stop()
        return loop_cpu, thread_cpu  # µs per second

    off, extra = _paired(lambda: asyncio.run(busy(False)), lambda: asyncio.run(busy(True)), 5)
    idles = [(asyncio.run(idle(True))[0] - asyncio.run(idle(False))[0], asyncio.run(idle(True))[1]) for _ in range(3)]
    return {"watchdog_busy_share": extra / off, "watchdog_idle_loop_us_per_s": statistics.median(i[0] for i in idles),
            "watchdog_thread_us_per_s": statistics.median(i[1] for i in idles)}


def print_costs(console: Console, costs: dict[str, float], runs: list[dict[str, Any]]) -> None:
    from servprof.auto.steps import DISCOVERY_STEPS, MAX_DISCOVERY_STEPS

    table = Table(title="what zero-touch costs: CPU time in the thread doing the work (medians of interleaved rounds)")
    table.add_column("item")
    table.add_column("cost", justify="right")
    table.add_column("per request", justify="right")
    steps_per_request = (runs[0]["max_tokens"] if runs else 64) + 1
    table.add_row("no session: Thread.start patch", f"{costs['thread_start_patch_us']:.2f} µs per thread start "
                  f"({costs['thread_start_us']:.0f} µs per start)", f"{costs['thread_start_patch_us']:.2f} µs (1 thread)")
    table.add_row("no session: route filter (sampling on)", f"{costs['route_filter_us']:.2f} µs per request",
                  f"{costs['route_filter_us']:.2f} µs")
    hooks = costs["hooks_per_step_us"]
    per_call = costs["global_hooks_per_call_us"]
    for name in ("hf", "loop"):
        step, calls = costs[f"{name}_step_us"], costs[f"{name}_module_calls_per_step"]
        table.add_row(f"session: step hooks, {name} server's model",
                      f"{hooks:.1f} µs per step ({hooks / step:.1%} of its {step:.0f} µs step; the profiler itself "
                      f"+{costs[f'{name}_profiler_per_step_us']:.0f} µs)",
                      f"{hooks * steps_per_request / 1e3:.2f} ms ({steps_per_request} steps)")
        table.add_row(f"session: global hooks while discovering, {name} ({calls:.0f} module calls/step)",
                      f"{per_call:.2f} µs per module call = {per_call * calls:.0f} µs per step",
                      f"the first {DISCOVERY_STEPS} steps of a session (up to {MAX_DISCOVERY_STEPS} "
                      "while sampled requests wait for a model already found)")
    table.add_row("session: tokenizer patch", f"{costs['tokenizer_patch_per_call_us']:.2f} µs per call "
                  f"({costs['tokenize_call_us']:.0f} µs per encode)",
                  f"{costs['tokenizer_patch_per_call_us'] * (steps_per_request + 1):.0f} µs "
                  f"(1 encode + {steps_per_request} decodes)")
    rps = statistics.median([r["requests"] / r["load_s"] for r in runs if r.get("requests")] or [float("nan")])
    table.add_row("session: watchdog on a busy loop", f"{costs['watchdog_busy_share']:.1%} of the loop's CPU "
                  f"(200 µs handlers back to back)", f"{costs['watchdog_busy_share']:.1%} of each request's loop time")
    table.add_row("session: watchdog on an idle loop", f"{costs['watchdog_idle_loop_us_per_s']:.0f} µs/s of loop CPU "
                  f"(heartbeats wake it) + {costs['watchdog_thread_us_per_s']:.0f} µs/s on its thread",
                  f"{(costs['watchdog_idle_loop_us_per_s'] + costs['watchdog_thread_us_per_s']) / rps:.0f} µs at "
                  f"{rps:.1f} requests/s")
    console.print(table)


if __name__ == "__main__":
    print_costs(Console(width=140), measure_costs(), [])
