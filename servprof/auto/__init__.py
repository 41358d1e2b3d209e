"""Automatic (zero-touch) phases: model steps, tokenization and the requests they serve,
marked by servprof itself while a session runs and only then.

Installed on the capture thread right after the profiler starts and removed right after
it stops; between sessions nothing is patched or registered, except one patch put in
when the middleware is created: ``threading.Thread.start`` notes the request a thread was
started for (servprof.auto.context), so that a thread started before a session still
carries its request's id into the session. ``SERVPROF_AUTO_INSTRUMENT=0``
turns it off. Phases a server marks itself with ``servprof.phase`` win over these on the
trace side (servprof.trace.phases). What is patched and what it costs: docs/middleware.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from servprof.auto.compiled import compiled_model_present
from servprof.auto.context import install_thread_inheritance
from servprof.auto.emit import range_kind, set_range_kind
from servprof.auto.steps import StepHooks
from servprof.auto.tokenizers import TARGETS, TokenizerPatches
from servprof.budget import LiveSignals
from servprof.trace.meta import BUDGET_HOW, GPU_EVENTS_NOTE, NO_FORWARD_LEAD, NO_STEP_BEGAN_LEAD

__all__ = ["AutoInstrumentation", "compiled_model_present", "install_thread_inheritance", "range_kind", "set_range_kind"]

MAX_THREADS_LISTED = 64
# Engines that run the model in processes of their own, when loaded here, and how to profile those.
ENGINE_HINTS = {
    "vllm": " vLLM is loaded in this process, and it runs the model in its engine-core processes: use "
            "`servprof.integrations.vllm.VLLMMiddleware` (`vllm serve --middleware ...`), which drives vLLM's own "
            "profiler in them.",
    "sglang": " SGLang is loaded in this process, and it runs the model in its scheduler processes: record them with "
              "its profiler (`POST /start_profile`, SGLANG_TORCH_PROFILER_DIR) and read the traces with "
              "`servprof analyze`.",
}
COMPILED = ("a torch.compile'd model runs in this process: servprof registers no module hooks (adding or "
            "removing them could make it recompile). A deep window reads its steps from the compiled regions "
            "torch records, without prefill or decode and without request ids; a light session records no "
            "region. For both, mark each step with `with servprof.phase('decode_step'):` (or 'prefill')")

DIRECT_FORWARD = ("{model} runs the model without Module.__call__ ({where}): a model run so (`model.forward(x)`, "
                  "or a `__call__` of its own) runs no module hook, so servprof cannot mark its steps, and does not "
                  "count its parts as steps. Call the model itself (`model(x)`), or mark each step with "
                  "`with servprof.phase('decode_step'):` (or 'prefill').")
HOOK_FAILED = ("servprof's step hook raised an error after {steps} step(s) of this session were marked, and marked "
               "none after it (the model's calls went on unaffected): {failure}. Please report it; meanwhile mark "
               "each step with `with servprof.phase('decode_step'):` (or 'prefill'), or set "
               "SERVPROF_AUTO_INSTRUMENT=0")


class AutoInstrumentation:
    """Process-wide (the hooks and patches are process-wide too); one session at a time."""

    def __init__(self) -> None:
        self.steps = StepHooks()
        self.tokenizers = TokenizerPatches()
        self.running = False
        self.hooks_active = False
        self.problem: str | None = None  # why steps are not marked automatically

    def start(self, session_request_ids: Callable[[], list[str]], on_step: Callable[[int], None] | None,
              on_calls: Callable[[int], bool] | None = None, call_limit: int | None = None) -> None:
        self.running = True
        self.problem = COMPILED if compiled_model_present() else None
        self.hooks_active = self.problem is None
        install_thread_inheritance()  # normally in place since the middleware was created
        if self.hooks_active:
            self.steps.start(session_request_ids, on_step, on_calls, call_limit)
        else:  # no hook: nothing counted, not a former session's counts
            self.steps.clear()
        self.tokenizers.install()

    def stop(self) -> None:
        """Before the profiler's stop(): nothing new opens; open ranges still close."""
        self.steps.stop()
        self.tokenizers.active = False
        if self.steps.failure and self.problem is None:
            self.problem = HOOK_FAILED.format(steps=self.steps.steps, failure=self.steps.failure)

    def remove(self) -> None:
        """After the profiler's stop(): every hook and patch goes away."""
        if not self.running:
            return
        self.running = False
        self.steps.remove()
        self.tokenizers.remove()

    def live(self) -> LiveSignals:
        steps = self.steps
        return LiveSignals(hooks_active=self.hooks_active and self.running, steps=steps.steps,
                           open_steps=steps.open_steps, next_step_share=steps.next_step_share,
                           module_calls=steps.module_calls, discovering=steps.discovering,
                           calls_per_step=steps.calls_per_step)

    def summary(self) -> dict[str, Any]:
        steps = self.steps
        return {"steps": steps.steps if self.hooks_active else None, "running_at_stop": steps.open_steps,
                "prefill": steps.prefill_steps,
                "decode": steps.decode_steps, "module_calls_per_step": steps.calls_per_step,
                "models": sorted(steps.models),
                # Models that take no hooks of their own (TorchScript): the global hooks stayed on to mark them.
                "models_marked_by_global_hooks": sorted(steps.unhookable_models),
                # Models run without Module.__call__ (no hooks run): "Class.forward" -> where it was called.
                "forward_called_directly": dict(steps.direct_forwards),
                "tokenizer_libraries": list(self.tokenizers.libraries),
                "tokenizer_calls": dict(self.tokenizers.calls),
                # [tid, start ns (perf_counter_ns), wall ns, the thread's CPU ns] of one text's calls from 1 ms
                "tokenizer_cpu_ns": [list(call) for call in self.tokenizers.timed], "range_kind": range_kind(),
                "problem": self.problem,
                # Threads whose steps had no request of their own (named the requests in flight): an
                # engine's, a pool's. A thread not listed ran steps for the request it was started for.
                "threads_without_request": sorted(steps.threads_without_request)[:MAX_THREADS_LISTED]}

    def missing(self, budget_spent: bool = False) -> list[dict[str, str]]:
        """What the automatic phases could not mark in this session, and how to get it. ``budget_spent``:
        the session ended at its event budget."""
        out = []
        if self.problem:
            out.append({"what": "automatic model steps", "message": self.problem[0].upper() + self.problem[1:] + "."})
        elif self.steps.direct_forwards:
            out.append({"what": "automatic model steps", "message": " ".join(
                DIRECT_FORWARD.format(model=model, where=where) for model, where in self.steps.direct_forwards.items())})
        elif self.steps.steps == 0 and self.steps.module_calls > 0:
            # Modules ran, inside forwards begun before the session: the model is here, no step began.
            out.append({"what": "automatic model steps", "message": _no_step_began(self.steps.module_calls,
                                                                                   budget_spent)})
        elif self.steps.steps == 0:
            out.append({"what": "automatic model steps", "message": (
                f"{NO_FORWARD_LEAD}: the sampled requests "
                "did not run the model, or it runs in another process (a process pool, a worker or engine process, "
                "a remote server), or it is not built from nn.Module. servprof records the process it is added to: "
                "run the model there, or record the process that runs it with torch.profiler and read that trace "
                "with `servprof analyze`; a model that is not an nn.Module can mark its steps with "
                "`with servprof.phase('decode_step'):` (or 'prefill')." + _engine_hint())})
        if not self.tokenizers.libraries:
            names = ", ".join(TARGETS)
            out.append({"what": "tokenizer library", "message": (
                f"No tokenizer library servprof knows ({names}) was loaded in this process, so tokenization was "
                "not timed automatically: mark it with `with servprof.phase('tokenize'):`; if it runs in another "
                "process (a process pool, an engine's API server), that process's trace holds it.")})
        return out


def _no_step_began(module_calls: int, budget_spent: bool) -> str:
    text = (f"{NO_STEP_BEGAN_LEAD}, though the model runs in this process: {module_calls} module call(s) ran "
            "inside forwards already under way when it started. ")
    if not budget_spent:
        return text + ("The session ended (its sampled requests done, or a limit reached) before a step began; a "
                       "session that samples more requests (SERVPROF_REQUESTS_PER_SESSION) or longer ones records "
                       "their steps.")
    return text + (
        f"The session reached its event budget (SERVPROF_MAX_SESSION_EVENTS) first: {GPU_EVENTS_NOTE}, so a "
        f"busy server's forwards can fill a light session's budget within one step. {BUDGET_HOW}.")


def _engine_hint() -> str:
    return "".join(hint for module, hint in ENGINE_HINTS.items() if module in sys.modules)
