"""The demo server marks its phases for servprof: a real torch.profiler run around real
requests shows tokenize, prefill, decode_step (one range per batched step, naming every
request in the batch) and detokenize ranges tagged with the right request ids; and with
ServprofMiddleware in front the request id comes from the middleware."""

from __future__ import annotations

import asyncio
import gzip
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import orjson
import torch
from _demo_helpers import get_stats, serve_app, start_demo_server, wait_for
from torch._C._profiler import _ExperimentalConfig

from servprof.capture import get_controller
from servprof.phases import parse_phase_event_name


async def _two_concurrent_streams(url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions",
                    json={"prompt": f"Notes on caching {i}", "max_tokens": 12, "stream": True},
                )
                for i in range(2)
            )
        )


def _no_other_profiler() -> bool:
    # One profiler per process: wait out servprof's capture thread if another test left it busy.
    controller = get_controller()
    busy = controller.session is not None or (controller.warmup_wanted and not controller.warm)
    return not busy and not torch.autograd.profiler._is_profiler_enabled


def test_phases_in_a_real_profile(tmp_path: Path):
    wait_for(_no_other_profiler, timeout=60)
    with start_demo_server(size="tiny", max_batch=4) as url:
        before = get_stats(url)
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        profiler.start()
        try:
            asyncio.run(_two_concurrent_streams(url))
        finally:
            profiler.stop()
        after = get_stats(url)
    trace_path = tmp_path / "trace.json.gz"
    profiler.export_chrome_trace(str(trace_path))
    events = orjson.loads(gzip.decompress(trace_path.read_bytes()))["traceEvents"]

    phases: dict[str, Counter[str]] = defaultdict(Counter)
    decode_batches: list[list[str]] = []
    for event in events:
        parsed = parse_phase_event_name(event.get("name", ""))
        if parsed is None or event.get("ph") != "X":
            continue
        name, ids = parsed
        if name == "decode_step":
            decode_batches.append(ids)
        for request_id in ids:
            phases[name][request_id] += 1

    # Thread ids in /demo/stats are the ones the trace shows: tokenization ran off the loop,
    # the decode steps on the engine thread.
    threads = {
        name: {e["tid"] for e in events if e.get("name", "").startswith(f"servprof:{name}|")}
        for name in ("tokenize", "decode_step")
    }
    assert threads["decode_step"] == {after["engine_thread_native_id"]}
    assert after["event_loop_thread_native_id"] not in threads["tokenize"]
    requests = after["recent_requests"][-2:]
    request_ids = {r["request_id"] for r in requests}
    assert len(request_ids) == 2
    for record in requests:
        rid = record["request_id"]
        assert phases["tokenize"][rid] == 1
        assert phases["prefill"][rid] == 1
        assert phases["detokenize"][rid] == record["output_tokens"]
        # The prefill samples the first token; every later one comes from a decode step
        # (an end-of-text token, rare with random weights, is sampled but not output).
        if record["finish_reason"] == "length":
            assert phases["decode_step"][rid] == record["output_tokens"] - 1
        else:
            assert phases["decode_step"][rid] >= record["output_tokens"]
    # One range per engine step, naming the whole batch; the queue phase is inferred, not marked.
    assert len(decode_batches) == after["decode_steps"] - before["decode_steps"]
    assert all(set(batch) <= request_ids for batch in decode_batches)
    assert "queue" not in phases


def test_request_id_comes_from_the_servprof_middleware(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("SERVPROF_OUT_DIR", str(tmp_path))
    monkeypatch.setenv("SERVPROF_TELEMETRY", "0")
    monkeypatch.setenv("SERVPROF_WARMUP", "0")
    with start_demo_server(size="tiny", max_batch=2, servprof=True) as url:
        response = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hello", "max_tokens": 3},
            headers={"x-request-id": "demo-test-id-42"},
            timeout=60,
        )
        assert response.status_code == 200
        assert response.json()["id"] == "cmpl-demo-test-id-42"
        assert get_stats(url)["recent_requests"][-1]["request_id"] == "demo-test-id-42"


class _RecordProbe:
    """A RequestObserver that keeps what the middleware hands it at request end."""

    def __init__(self) -> None:
        self.ended: dict[str, dict] = {}

    def on_request_start(self, record, scope):
        return None

    def on_request_end(self, record, state) -> None:
        self.ended[record.request_id] = dict(record.attributes)

    def on_analysis(self, result, records) -> None:
        pass


def test_token_counts_reach_the_middlewares_request_record(monkeypatch, tmp_path: Path):
    from servprof.demo.app import create_app
    from servprof.demo.config import DemoConfig
    from servprof.middleware import ServprofMiddleware

    monkeypatch.setenv("SERVPROF_OUT_DIR", str(tmp_path))
    monkeypatch.setenv("SERVPROF_TELEMETRY", "0")
    monkeypatch.setenv("SERVPROF_WARMUP", "0")
    app = create_app(DemoConfig(size="tiny", max_batch=2, servprof=True))
    probe = _RecordProbe()
    with serve_app(app) as url:
        httpx.get(f"{url}/health")  # the middleware stack is built on the first request
        layer = app.middleware_stack
        while not isinstance(layer, ServprofMiddleware):
            layer = layer.app
        layer.runtime.observers.append(probe)
        plain = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hi there", "max_tokens": 4},
            headers={"x-request-id": "plain-1"},
            timeout=60,
        ).json()
        payload = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        streamed = httpx.post(
            f"{url}/v1/chat/completions", json=payload, headers={"x-request-id": "stream-1"}, timeout=60
        ).text
        wait_for(lambda: len(probe.ended) == 2)
    usage = orjson.loads(streamed.split("data: ")[-2])["usage"]
    for request_id, expected in (("plain-1", plain["usage"]), ("stream-1", usage)):
        attributes = probe.ended[request_id]
        assert attributes["gen_ai.usage.input_tokens"] == expected["prompt_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == expected["completion_tokens"]
        assert attributes["gen_ai.response.model"] == "servprof-demo-tiny"
        assert attributes["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
