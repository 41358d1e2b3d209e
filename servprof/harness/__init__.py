"""Locust harness that replays LLM traffic against OpenAI-compatible servers.

In a locustfile:

    from servprof.harness import OpenAIUser

    class LLMUser(OpenAIUser):
        pass

The locust parts are imported lazily (locust patches the standard library through
gevent when it is imported), so datasets and arrival schedules can be used anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servprof.harness.arrivals import ARRIVALS, ArrivalError, Pacer
from servprof.harness.datasets import (
    DATASET_NAMES,
    DatasetError,
    RequestSpec,
    load_custom_jsonl,
    load_dataset,
    load_sharegpt,
    load_trace_jsonl,
    synthetic_mix,
)
from servprof.harness.summary import Collector, SLOError, parse_slo, summarize

__all__ = [
    "ARRIVALS", "ArrivalError", "Collector", "DATASET_NAMES", "DatasetError", "OpenAIUser", "Pacer",
    "RequestSpec", "SLOError", "load_custom_jsonl", "load_dataset", "load_sharegpt", "load_trace_jsonl",
    "parse_slo", "summarize", "synthetic_mix",
]

if TYPE_CHECKING:
    from servprof.harness.users import OpenAIUser


def __getattr__(name: str) -> Any:
    if name == "OpenAIUser":
        from servprof.harness.users import OpenAIUser

        return OpenAIUser
    raise AttributeError(f"module 'servprof.harness' has no attribute {name!r}")
