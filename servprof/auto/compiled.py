"""Whether torch.compile has compiled anything in this process (read without importing dynamo)."""

from __future__ import annotations

import sys


def compiled_model_present() -> bool:
    """True once torch.compile has compiled a frame in this process. ``frames.ok`` counts frames
    compiled allowing graph breaks; a ``fullgraph=True`` compile counts only as a graph in
    ``stats.unique_graphs``."""
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a torch without it compiles nothing we know of
        return False
    return bool(counters.get("frames", {}).get("ok") or counters.get("stats", {}).get("unique_graphs"))
