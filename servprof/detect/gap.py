"""One gap in the model's work (gaps.py finds them; stalled_steps.py the ones inside a step on a
CPU trace), and the host thresholds both judge by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CPU_MIN_GAP_US = 1000.0  # host gaps below 1 ms are the ordinary cost of a Python engine loop
RELATIVE_MIN_GAP = 0.25  # ... and a host gap must be at least this share of the median step
# How to give steps of unknown kind one, said wherever a rule left them unjudged.
STEP_KIND_HINT = ("To have them judged, mark the steps (servprof.phase(\"decode_step\"), or torch.profiler."
                  "record_function ranges such as \"prefill\" and \"decode_step\" around each step), or record with "
                  "record_shapes=True (the embedding's input shape tells a prefill from a decode step); with_stack=True "
                  "names what the thread was in.")


Description = tuple[str, dict[str, Any]]  # (explanation, evidence)


@dataclass
class Gap:
    rank: int
    start_us: float
    end_us: float
    idle_us: float
    where: str  # "between_steps" | "inside_step"
    cause: str
    # (explanation, evidence), or what makes them when first read: a trace of a million steps has
    # as many gaps, and the reports show a few per cause (reading the frames is most of the work).
    description: Description | Callable[[], Description]
    request_ids: list[str] = field(default_factory=list)
    count: int = 1  # > 1: short gaps of one step and cause, summed (start/end: the step's span)
    step: int = -1  # index in the steps list of the step it belongs to (between: the step after it)

    @property
    def explanation(self) -> str:
        return self._described()[0]

    @property
    def evidence(self) -> dict[str, Any]:
        return self._described()[1]

    def _described(self) -> Description:
        if callable(self.description):
            self.description = self.description()
        return self.description

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_us": self.start_us,
            "end_us": self.end_us,
            "idle_us": round(self.idle_us, 1),
            "where": self.where,
            "cause": self.cause,
            "explanation": self.explanation,
            "count": self.count,
            "request_ids": self.request_ids[:20],
            **self.evidence,
        }
