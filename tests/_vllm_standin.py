"""A thin stand-in for vLLM's engine, for tests on a machine without a GPU.

Everything above the engine is vLLM's real code: the argument parser, VllmConfig /
ModelConfig built from a local tiny model directory, the renderer (tokenization on
vLLM's one-thread pool), InputProcessor, `build_app` with `--middleware`, and
`init_app_state`. Only the engine client is a stand-in, because vLLM's engine needs
a GPU build (`vllm._C`). It is kept thin:

- `generate()` feeds requests to an engine thread that batches every active request
  into one step, like vLLM's scheduler, and streams `RequestOutput`s back to the
  event loop, where the text is detokenized (vLLM also detokenizes there).
- Each step runs a real tiny torch model in one worker *process* per rank, inside
  vLLM's own step annotation `execute_context_N(...)_generation_M(...)`.
- `start_profile` / `stop_profile` drive vLLM's real `TorchProfilerWrapper` in every
  worker, so real vLLM trace files (`<prefix>_dp0_pp0_tpR_dcp0_ep0_rankR.<ns>.pt.trace.json.gz`)
  are written, one per rank; the session guard raises vLLM's real
  `ProfilerAlreadyActiveError`, and a missing `--profiler-config` raises the worker's
  own "Profiling is not enabled" error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

TINY_VOCAB_TEXT = (
    "the quick brown fox jumps over the lazy dog while a server streams tokens to many clients "
    "profilers sample requests and find gaps between decode steps and slow tokenizers "
)


def make_tiny_model_dir(path: Path) -> Path:
    """A local Hugging Face Llama directory (config + a real BPE tokenizer), no weights:
    enough for vLLM's ModelConfig and renderer; the stand-in workers make their own weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists():
        return path
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([TINY_VOCAB_TEXT * 20] * 10, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    }))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "float32",
    }))
    return path


# ---------------------------------------------------------------- worker process


def _worker_main(rank: int, vocab_size: int, profiler_config: Any, conn: Any) -> None:
    """One 'GPU worker': a real tiny torch model and vLLM's real profiler wrapper."""
    import torch
    from vllm.profiler.wrapper import create_worker_profiler

    torch.manual_seed(rank)
    hidden = 256
    embed = torch.nn.Embedding(vocab_size, hidden)
    layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(4))
    head = torch.nn.Linear(hidden, vocab_size)
    profiler = None
    while True:
        message = conn.recv()
        kind = message[0]
        try:
            if kind == "step":
                _, annotation, last_tokens = message
                context = profiler.annotate_context_manager(annotation) if profiler is not None else None
                with torch.inference_mode():
                    if context is not None:
                        context.__enter__()
                    try:
                        x = embed(torch.tensor(last_tokens))
                        for layer in layers:
                            x = torch.nn.functional.silu(layer(x))
                        tokens = head(x).argmax(-1).tolist()
                    finally:
                        if context is not None:
                            context.__exit__(None, None, None)
                if profiler is not None:
                    profiler.step()
                conn.send(("ok", tokens))
            elif kind == "profile":
                _, is_start, prefix, delay, max_iterations, kwargs = message
                if profiler_config is None or profiler_config.profiler is None:
                    raise RuntimeError(
                        "Profiling is not enabled. Please set --profiler-config to enable profiling."
                    )
                # vLLM's worker names traces '<prefix>_dp0_pp0_tp0_dcp0_ep0_rank0'.
                suffix = f"dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}"
                name = f"{prefix}_{suffix}" if prefix else suffix
                if is_start:
                    if profiler is None:
                        profiler = create_worker_profiler(
                            profiler_config, worker_name=name, local_rank=rank, profiler_kwargs=kwargs
                        )
                    profiler.set_output_name(name)
                    profiler.start(delay_iterations=delay, max_iterations=max_iterations)
                elif profiler is not None:
                    profiler.stop()
                conn.send(("ok", None))
            elif kind == "stop":
                if profiler is not None:
                    profiler.shutdown()
                conn.send(("ok", None))
                return
        except Exception as exc:  # reported to the engine, like a worker RPC error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------- engine client


class _Request:
    def __init__(self, request_id: str, prompt_ids: list[int], max_tokens: int, queue: asyncio.Queue):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.queue = queue
        self.output_ids: list[int] = []
        self.prefilled = False


def make_standin_engine_client_class():
    """Built lazily so importing this module does not import vLLM."""
    from vllm.engine.protocol import EngineClient
    from vllm.exceptions import ProfilerAlreadyActiveError
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    class StandInEngineClient(EngineClient):
        """See the module docstring: the only stand-in between vLLM's real API server and
        real worker-side profiling."""

        def __init__(self, vllm_config: Any, ranks: int = 1, step_delay_s: float = 0.002):
            self.vllm_config = vllm_config
            self.model_config = vllm_config.model_config
            self.renderer = renderer_from_config(vllm_config)
            self.input_processor = InputProcessor(vllm_config, self.renderer)
            self.tokenizer = self.renderer.get_tokenizer()
            self.step_delay_s = step_delay_s
            self.steps = 0
            self.trace_headers: dict[str, Any] = {}  # what vLLM's serving layer passed per request
            self._profile_session_active = False
            self._profile_lock = asyncio.Lock()
            self._pending: list[_Request] = []
            self._active: dict[str, _Request] = {}
            self._aborted: set[str] = set()
            self._lock = threading.Lock()
            self._wake = threading.Event()
            self._running = True
            self._loop: asyncio.AbstractEventLoop | None = None
            ctx = mp.get_context("spawn")
            vocab = self.model_config.get_vocab_size()
            profiler_config = vllm_config.profiler_config
            if profiler_config is not None and profiler_config.profiler is None:
                profiler_config = None
            self._workers = []
            for rank in range(ranks):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_worker_main, args=(rank, vocab, profiler_config, child), daemon=True)
                process.start()
                self._workers.append((process, parent))
            self._rpc_lock = threading.Lock()
            self._thread = threading.Thread(target=self._engine_loop, name="standin-engine-core", daemon=True)
            self._thread.start()

        # -- worker RPC (like vLLM's collective_rpc: every rank, results gathered)
        def _rpc(self, message: tuple) -> list[Any]:
            with self._rpc_lock:
                for _, conn in self._workers:
                    conn.send(message)
                replies = [conn.recv() for _, conn in self._workers]
            errors = [detail for status, detail in replies if status == "error"]
            if errors:
                raise RuntimeError(errors[0])
            return [detail for _, detail in replies]

        # -- the engine core loop: one batched step over every active request
        def _engine_loop(self) -> None:
            while self._running:
                with self._lock:
                    for request in self._pending:
                        self._active[request.request_id] = request
                    self._pending.clear()
                    for request_id in self._aborted:
                        self._active.pop(request_id, None)
                    self._aborted.clear()
                    batch = list(self._active.values())
                if not batch:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                ctx = [r for r in batch if not r.prefilled]
                gen = [r for r in batch if r.prefilled]
                ctx_tokens = sum(len(r.prompt_ids) for r in ctx)
                annotation = f"execute_context_{len(ctx)}({ctx_tokens})_generation_{len(gen)}({len(gen)})"
                last = [(r.output_ids or r.prompt_ids)[-1] for r in batch]
                tokens = self._rpc(("step", annotation, last))[0]
                self.steps += 1
                for request, token in zip(batch, tokens, strict=True):
                    request.prefilled = True
                    request.output_ids.append(int(token))
                    done = len(request.output_ids) >= request.max_tokens
                    if done:
                        with self._lock:
                            self._active.pop(request.request_id, None)
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(request.queue.put_nowait, (list(request.output_ids), done))
                time.sleep(self.step_delay_s)

        # -- EngineClient API used by vLLM's serving layer
        is_running = True
        is_stopped = False
        errored = False
        dead_error = RuntimeError("engine dead")

        async def get_supported_tasks(self):
            return ("generate",)

        async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any):
            self._loop = asyncio.get_running_loop()
            self.trace_headers[request_id] = kwargs.get("trace_headers")
            prompt_ids = list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
            request = _Request(request_id, prompt_ids or [0], sampling_params.max_tokens or 16, asyncio.Queue())
            with self._lock:
                self._pending.append(request)
            self._wake.set()
            try:
                while True:
                    output_ids, done = await request.queue.get()
                    text = self.tokenizer.decode(output_ids)  # detokenized on the event loop, as in vLLM
                    completion = CompletionOutput(
                        index=0, text=text, token_ids=output_ids, cumulative_logprob=None, logprobs=None,
                        finish_reason="length" if done else None,
                    )
                    yield RequestOutput(
                        request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
                        prompt_logprobs=None, outputs=[completion], finished=done,
                    )
                    if done:
                        return
            finally:
                await self.abort(request_id)

        async def abort(self, request_id: Any) -> None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            with self._lock:
                self._aborted.update(ids)

        async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                                max_iterations: int | None = None, profiler_kwargs: dict | None = None) -> None:
            async with self._profile_lock:  # AsyncLLM's session guard
                if self._profile_session_active:
                    raise ProfilerAlreadyActiveError()
                self._profile_session_active = True
                try:
                    await asyncio.to_thread(
                        self._rpc, ("profile", True, profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
                    )
                except Exception:
                    self._profile_session_active = False
                    raise

        async def stop_profile(self) -> None:
            async with self._profile_lock:
                try:
                    await asyncio.to_thread(self._rpc, ("profile", False, None, None, None, None))
                finally:
                    self._profile_session_active = False

        def shutdown(self, timeout: float | None = None) -> None:
            if not self._running:
                return
            self._running = False
            self._wake.set()
            self._thread.join(timeout=5)
            with contextlib.suppress(OSError, EOFError, RuntimeError):
                self._rpc(("stop",))
            for process, _ in self._workers:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()

        # The rest of EngineClient: nothing the tests reach.
        def encode(self, *args: Any, **kwargs: Any):
            raise NotImplementedError("pooling is not part of the stand-in")

        async def is_tracing_enabled(self) -> bool:
            # As AsyncLLM: tracing is on when vLLM was given --otlp-traces-endpoint.
            return bool(getattr(self.vllm_config.observability_config, "otlp_traces_endpoint", None))

        async def do_log_stats(self) -> None:
            return None

        async def check_health(self) -> None:
            return None

        async def reset_mm_cache(self) -> None:
            return None

        async def reset_encoder_cache(self) -> None:
            return None

        async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            return True

        async def sleep(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def wake_up(self, *args: Any, **kwargs: Any) -> bool:
            return True

        async def is_sleeping(self) -> bool:
            return False

        async def add_lora(self, *args: Any) -> bool:
            return False

        async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def resume_generation(self) -> None:
            return None

        async def is_paused(self) -> bool:
            return False

        async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def release_kv_cache_memory(self) -> None:
            return None

    return StandInEngineClient


def build_vllm_app(cli_args: list[str], ranks: int = 1):
    """vLLM's real `build_app` + `init_app_state` from a `vllm serve` command line,
    with the stand-in engine client. Returns (app, engine_client)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli_args)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    engine_client = make_standin_engine_client_class()(vllm_config, ranks=ranks)
    app = build_app(args, ("generate",))
    asyncio.run(init_app_state(engine_client, app.state, args, ("generate",)))
    return app, engine_client
