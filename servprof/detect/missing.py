"""What a trace could not show, in one list: the serving side's entries, which know the process
(the trace's ``servprof`` metadata: automatic phases off or no forward seen, no tokenizer library,
no loop watched), then the detectors'. The live analysis and ``servprof analyze`` both say them."""

from __future__ import annotations

from typing import Any

from servprof.detect.refused import FAILED_WHAT, REFUSED_WHAT
from servprof.trace.meta import SERVING_STEP_LEADS


def merged_missing(*lists: Any) -> list[dict[str, str]]:
    """One ``summary["missing"]`` from the serving side's entries (the trace's ``servprof``
    metadata: automatic phases off or no forward seen, no tokenizer library, no loop watched), which
    know the process, and then the detectors'."""
    out: list[dict[str, str]] = []
    for entries in lists:
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("message"), str) and entry not in out:
                out.append({"what": str(entry.get("what", "")), "message": entry["message"]})
    # The serving side saw no forward in its process at all, or no step begin: that says more than "no
    # step in the trace" (its other entries, a compiled model or hooks that failed, leave the trace's
    # how-to standing).
    if any(entry["message"].startswith(SERVING_STEP_LEADS) for entry in out):
        out = [entry for entry in out if entry["what"] != "model steps"]
    # Sampled requests the app refused or failed explain the other entries (no model work ran): first.
    return sorted(out, key=lambda entry: entry["what"] not in (REFUSED_WHAT, FAILED_WHAT))
