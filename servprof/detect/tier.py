"""Which capture tier a trace comes from, and what a light one cannot show: the wording every
detector uses for it, in one place.

A light session (servprof.tiers) records user-scope ranges only (servprof's phases, the
automatic ones, tokenizer phases, the engine's own ``record_function`` ranges) and, on CUDA,
the device activity and runtime calls CUPTI delivers: no ``cpu_op``, no Python frames, no
shapes. Nothing in it says what a thread ran between those ranges, so a detector reading a
light trace never names a cause from the absence of ops: it says the cause needs a deep
window. A trace without servprof's metadata (a public trace, a script's) is judged as it is.
"""

from __future__ import annotations

from typing import Any

from servprof.trace.meta import BUDGET_HOW, GPU_EVENTS_NOTE
from servprof.trace.model import RUNTIME_CATEGORIES

LIGHT, DEEP = "light", "deep"  # (servprof.tiers' names; this module must not import torch)

# How to get a deep window, for every message that needs one.
DEEP_WINDOW_HOW = (
    "a deep window records every op for a few steps: SERVPROF_DEEP_EVERY=k takes one after every k light "
    "sessions (default 4), `POST /servprof/sample?n=2&tier=deep` takes one now, SERVPROF_DEEP_STEPS=N sets its "
    "decode steps (default 2), SERVPROF_TIER=deep makes every session deep; add SERVPROF_RECORD_SHAPES=1 for op "
    "shapes (bandwidth)"
)
NEEDS_DEEP = "op-level cause needs a deep window"
NEEDS_DEEP_CAUSE = "needs_deep_window"  # decode_gap evidence["cause"] on a light trace (causes.CAUSES)
LIGHT_TRACE = ("a light trace records servprof's phases, the engine's annotations and device activity, not the "
               "ops or Python each thread ran")
# Fewer model steps than this in a session cut by its event budget: too few for the gaps between them.
MIN_STEPS = 4
EARLY_SHARE = 0.5  # a session cut with less than this share of its budget recorded: the estimate ran high
FLOW_CATEGORY = "ac2g"  # the link from a launch to its kernel
BANDWIDTH_NOTE = (f"op bytes and bandwidth need op shapes, which a light trace does not record (kernels carry no "
                  f"bytes): {DEEP_WINDOW_HOW}")


def tier_of(trace: Any) -> str | None:
    """"light" or "deep" from the trace's servprof metadata; None for any other trace."""
    tier = trace.servprof_metadata().get("tier")
    return tier if tier in (LIGHT, DEEP) else None


def is_light(trace: Any) -> bool:
    return tier_of(trace) == LIGHT


def light_missing(trace: Any, gaps_needing_deep: int) -> list[dict[str, str]]:
    """The summary["missing"] entry of a light trace: what it cannot show, and how to get it.
    (Empty for every other trace.)"""
    if not is_light(trace):
        return []
    cannot = ["the op or Python code behind a gap"
              + (f" ({gaps_needing_deep} gap(s) here say '{NEEDS_DEEP}')" if gaps_needing_deep else ""),
              "op bytes and bandwidth (the roofline)"]
    if not trace.has_device_events():
        cannot += ["reads of a tensor on the host every step (.item(), .tolist())",
                   "how much of each step its thread spent working, and stalls inside slow steps"]
    measured = "step and gap times, device idle, syncs and copies the CUDA runtime saw, and tokenization" \
        if trace.has_device_events() else "step and gap times and tokenization"
    return [{"what": "op-level detail (light trace)", "message": (
        f"This is a light session's trace: {LIGHT_TRACE}. It cannot show {'; '.join(cannot)}. Its {measured} are "
        f"measured as in a deep trace. For the rest, {DEEP_WINDOW_HOW}.")}]


def budget_missing(trace: Any, steps: list[Any]) -> list[dict[str, str]]:
    """The summary["missing"] entry of a servprof session that its event budget ended before it held a
    few model steps: the gaps between steps were not there to judge, and why. On a GPU the CUDA
    activity fills the budget: every kernel the process launches, with its launch and their link."""
    meta = trace.servprof_metadata()
    if meta.get("stop_reason") != "max_session_events" or len(steps) >= MIN_STEPS:
        return []
    budget = meta.get("event_budget")
    held = f"{len(trace):,} events recorded" + (f", a budget of {budget:,}" if budget else "")
    text = (f"This session stopped at its event budget (estimated while it ran) after {len(steps)} model "
            f"step(s) ({held}): too few steps to judge the gaps between them. ")
    if trace.has_device_events():
        device = trace.device_mask()
        cuda = int((device | trace.mask_category(*RUNTIME_CATEGORIES, FLOW_CATEGORY)).sum())
        text += (f"{cuda:,} of those events are CUDA activity ({int(device.sum()):,} kernels and copies, their "
                 f"launches and links): {GPU_EVENTS_NOTE}. ")
    if budget and len(trace) < EARLY_SHARE * budget:
        text += (f"It holds {len(trace) / budget:.0%} of that budget: the live estimate ran high (until it has "
                 "measured a model's events per step, servprof assumes many). It learns them from each session, and "
                 "later sessions size themselves by them.")
        return [{"what": "model steps (event budget)", "message": text}]
    return [{"what": "model steps (event budget)", "message": text + BUDGET_HOW + "."}]
