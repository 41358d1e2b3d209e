"""`servprof demo-server`: serve the demo LLM (OpenAI-compatible) with uvicorn.

    servprof demo-server --host 127.0.0.1 --port 8000 --size tiny
    python -m servprof.demo.server --port 8000 --step-delay-ms 20

Every flag has a SERVPROF_DEMO_* env var (the flag wins); see docs/readme-demo-server.md.
"""

from __future__ import annotations

import argparse
import sys

from servprof.demo.config import COMPILE_BACKENDS, DTYPES, DemoConfig
from servprof.demo.model import SIZES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0 = any free port)"
    )
    parser.add_argument("--size", choices=list(SIZES), default=None, help="model size (default tiny)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu)")
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default=None,
        help="weights/activations dtype (default auto: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=None, help="KV-cache slots = largest decode batch (16)"
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens accepted (0 = min(1024, context/2))",
    )
    parser.add_argument(
        "--context", type=int, default=None, help="context length (tiny 2048, small 2048, 1b 4096)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random weights (0)")
    parser.add_argument("--model-name", default=None, help="name served in responses (servprof-demo-<size>)")
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="serve a local Hugging Face Llama/Mistral directory instead (needs transformers; "
        "never downloads)",
    )
    parser.add_argument(
        "--no-servprof",
        dest="servprof",
        action="store_false",
        default=None,
        help="serve without ServprofMiddleware",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile the decode step (static shapes; batches padded to buckets warmed up at start-up)",
    )
    parser.add_argument(
        "--compile-backend",
        choices=list(COMPILE_BACKENDS),
        default=None,
        help="torch.compile backend (default inductor; eager compiles in a fraction of the time)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    knobs = parser.add_argument_group("fault knobs (off by default; each injects a known cause of slowness)")
    knobs.add_argument(
        "--tokenize-on-loop",
        action="store_true",
        default=None,
        help="(a) tokenize on the event loop instead of a worker thread",
    )
    knobs.add_argument(
        "--step-delay-ms",
        type=float,
        default=None,
        metavar="D",
        help="(b) busy host delay of D ms before every decode step",
    )
    knobs.add_argument(
        "--sync-per-step",
        action="store_true",
        default=None,
        help="(c) read the sampled tokens to the host after every step (a device sync)",
    )
    knobs.add_argument(
        "--slow-tokenizer-us-per-token",
        type=float,
        default=None,
        metavar="U",
        help="(d) extra Python CPU work of U microseconds per token, holding the GIL",
    )
    knobs.add_argument(
        "--unpadded-batches",
        action="store_true",
        default=None,
        help="(e) with --compile: run each decode batch at its own size, so every size outside the "
        "warmed-up buckets compiles the model again while serving",
    )
    knobs.add_argument(
        "--leak-mb-per-request",
        type=float,
        default=None,
        metavar="M",
        help="(f) every admitted request keeps M MiB (a cache that never frees)",
    )


CONFIG_FLAGS = (
    "size",
    "device",
    "dtype",
    "max_batch",
    "max_tokens_limit",
    "context",
    "seed",
    "model_name",
    "model_path",
    "servprof",
    "tokenize_on_loop",
    "step_delay_ms",
    "sync_per_step",
    "slow_tokenizer_us_per_token",
    "compile",
    "compile_backend",
    "unpadded_batches",
    "leak_mb_per_request",
)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig.from_env(**{name: getattr(args, name, None) for name in CONFIG_FLAGS})


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"servprof demo-server: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"servprof demo-server: --port must be 0..65535 (got {args.port})", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from servprof.demo.app import create_app
    except ImportError as exc:
        print(f"servprof demo-server: {exc}; install with: pip install 'servprof[demo]'", file=sys.stderr)
        return 2
    try:
        app = create_app(config)
    except (ValueError, RuntimeError, OSError) as exc:  # e.g. no CUDA device, out of memory, bad --model-path
        print(f"servprof demo-server: cannot build the model: {exc}", file=sys.stderr)
        return 2
    if config.servprof:
        _warm_up_profiler()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _warm_up_profiler() -> None:
    """Kineto's first start, here on the main thread that imported torch (before serving), so its
    one-time init prints no `External init callback must run in same thread` ERROR; the middleware
    then finds the profiler warm."""
    try:
        from servprof.capture import get_controller
        from servprof.settings import Settings

        settings = Settings.from_env()
    except Exception:  # noqa: BLE001 - the middleware reports bad settings itself, when it starts
        return
    if settings.enabled and settings.warmup:
        get_controller().warm_up_now()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m servprof.demo.server", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
