"""The demo server's configuration: model size, limits and the fault knobs.

Every field can be set by a `servprof demo-server` flag or a SERVPROF_DEMO_* env var
(the flag wins). The fault knobs are off by default; each one injects a known
cause of slowness so servprof's detectors can be tested against it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from servprof.demo.model import SIZES
from servprof.settings import parse_env_value

DTYPES = ("float32", "bfloat16", "float16")
COMPILE_BACKENDS = ("inductor", "eager", "aot_eager")  # torch.compile backends the demo accepts


@dataclass
class DemoConfig:
    size: str = "tiny"
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    max_batch: int = 16  # KV-cache slots = largest decode batch
    max_tokens_limit: int = 0  # largest max_tokens a request may ask for; 0 = min(1024, context / 2)
    context: int = 0  # positions per slot; 0 = size default
    seed: int = 0
    model_name: str = ""  # served name; "" = servprof-demo-<size>
    model_path: str = ""  # a local Hugging Face causal-LM directory (optional)
    servprof: bool = True  # put ServprofMiddleware in front when it is installed
    step_timeline: int = 4096  # decode steps kept in the ring buffer for /demo/stats
    # Fault knobs.
    tokenize_on_loop: bool = False  # (a) tokenize on the event loop, not a worker thread
    step_delay_ms: float = 0.0  # (b) synchronous host delay before every decode step
    sync_per_step: bool = False  # (c) read sampled tokens to the host every step
    slow_tokenizer_us_per_token: float = 0.0  # (d) extra Python CPU work per token
    compile: bool = False  # torch.compile the decode step (batches padded to warmed-up bucket sizes)
    compile_backend: str = "inductor"
    unpadded_batches: bool = False  # (e) with compile: each new batch size compiles again while serving
    leak_mb_per_request: float = 0.0  # (f) every admitted request keeps this many MiB that are never freed

    def __post_init__(self) -> None:
        self.validate()

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        return (
            os.path.basename(os.path.normpath(self.model_path))
            if self.model_path
            else f"servprof-demo-{self.size}"
        )

    @property
    def context_length(self) -> int:
        if self.context:
            return self.context
        if self.model_path:
            return 2048
        return {"tiny": 2048, "small": 2048, "1b": 4096}.get(self.size, 2048)

    @property
    def tokens_limit(self) -> int:
        return self.max_tokens_limit or min(1024, self.context_length // 2)

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def validate(self) -> None:
        problems = []
        if self.size not in SIZES and not self.model_path:
            problems.append(f"size must be one of {', '.join(SIZES)} (got {self.size!r})")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be cpu or cuda[:N] (got {self.device!r})")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            problems.append(f"dtype must be auto or one of {', '.join(DTYPES)} (got {self.dtype!r})")
        for name in ("max_batch", "step_timeline"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.context < 0 or (self.context and self.context < 8):
            problems.append(f"context must be 0 (size default) or >= 8 (got {self.context})")
        if self.max_tokens_limit < 0 or self.tokens_limit >= self.context_length:
            problems.append(
                f"max_tokens_limit ({self.max_tokens_limit}) must be 0 (auto) or from 1 to below "
                f"the context ({self.context_length})"
            )
        if self.step_delay_ms < 0 or self.slow_tokenizer_us_per_token < 0:
            problems.append("step_delay_ms and slow_tokenizer_us_per_token must be >= 0")
        if self.compile_backend not in COMPILE_BACKENDS:
            problems.append(f"compile_backend must be one of {', '.join(COMPILE_BACKENDS)} (got {self.compile_backend!r})")
        if self.unpadded_batches and not self.compile:
            problems.append("unpadded_batches needs compile (the knob changes how compiled decode batches are run)")
        if not 0 <= self.leak_mb_per_request <= 1024:
            problems.append(f"leak_mb_per_request must be from 0 to 1024 (got {self.leak_mb_per_request})")
        if problems:
            raise ValueError("invalid demo server configuration: " + "; ".join(problems))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> DemoConfig:
        """Defaults, then SERVPROF_DEMO_<FIELD> env vars, then `overrides`."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            var = f"SERVPROF_DEMO_{field.name.upper()}"
            raw = environ.get(var)
            if raw:  # unset or empty: the default, as for SERVPROF_* settings
                values[field.name] = parse_env_value(var, raw, field.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
