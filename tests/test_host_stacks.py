"""host_stacks' batched questions give the one-window answers: ThreadStack.top_keys equals top()
window by window (same frames, same order, same floats), on crafted stacks with ties and holes
and on a public trace's swept thread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servprof.detect import host_stacks
from servprof.detect.causes import Explained, GapExplainer
from servprof.detect.host_classes import CLASSES
from servprof.detect.host_stacks import HostStacks, ThreadStack
from servprof.detect.nesting import depths, levels, nearest, parents, start_order
from servprof.trace import load_trace

PUBLIC = Path(__file__).parent / "fixtures" / "public"


def _crafted(rng: np.random.Generator, size: int) -> ThreadStack:
    # Integer lengths: many equal totals, so the tie order (first appearance) is exercised.
    bounds = np.cumsum(np.concatenate([[rng.integers(0, 5)], rng.integers(1, 4, size)])).astype(float)
    name = rng.integers(-1, 6, size).astype(np.int32)  # -1: a hole
    cls = rng.integers(0, len(CLASSES), size).astype(np.int8)
    return ThreadStack(7, bounds, cls, name, np.zeros(size, dtype=bool))


def _one_by_one(stack: ThreadStack, a: np.ndarray, b: np.ndarray, names: list[str], limit: int) -> list:
    return [stack.top(float(x), float(y), names, limit) for x, y in zip(a, b, strict=True)]


def _batched(stack: ThreadStack, a: np.ndarray, b: np.ndarray, names: list[str], limit: int) -> list:
    window, key, us = stack.top_keys(a, b, limit)
    out: list[list[dict[str, object]]] = [[] for _ in range(a.size)]
    for w, k, v in zip(window.tolist(), key.tolist(), us.tolist(), strict=True):
        out[w].append({"name": names[k // len(CLASSES)], "class": CLASSES[k % len(CLASSES)], "self_us": round(v, 1)})
    return out


def _exact(stack: ThreadStack, a: np.ndarray, b: np.ndarray, limit: int) -> list[list[float]]:
    """Unrounded totals, window by window (top() rounds them: compare the floats themselves)."""
    window, _, us = stack.top_keys(a, b, limit)
    return [us[window == w].tolist() for w in range(a.size)]


def _reference_exact(stack: ThreadStack, a: np.ndarray, b: np.ndarray, limit: int) -> list[list[float]]:
    out = []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        lo, hi = int(np.searchsorted(stack.end, x, side="right")), int(np.searchsorted(stack.start, y, side="left"))
        clip = np.minimum(stack.end[lo:hi], y) - np.maximum(stack.start[lo:hi], x)
        spent = (clip > 0) & (stack.name[lo:hi] >= 0)
        key = stack.name[lo:hi][spent].astype(np.int64) * len(CLASSES) + stack.cls[lo:hi][spent]
        if key.size == 0:
            out.append([])
            continue
        _, first, which = np.unique(key, return_index=True, return_inverse=True)
        totals = np.bincount(which, weights=clip[spent])
        out.append(totals[np.lexsort((first, -totals))[:limit]].tolist())
    return out


@pytest.mark.parametrize("chunk", [host_stacks.TOP_CHUNK, 7])
def test_top_keys_is_top_window_by_window(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(host_stacks, "TOP_CHUNK", chunk)  # 7: many chunks of windows
    rng = np.random.default_rng(13)
    names = [f"frame{i}" for i in range(6)]
    for size in (0, 1, 2, 40, 500):
        stack = _crafted(rng, size)
        span = float(stack.bounds[-1]) + 3 if size else 5.0
        a = rng.uniform(-3, span, 60)
        a[:10] = np.round(a[:10])  # windows starting on a segment's bound
        b = a + rng.choice([0.0, 0.5, 1.0, 4.0, 30.0, -1.0], a.size)  # empty and reversed windows too
        for limit in (1, 3, 5):
            assert _batched(stack, a, b, names, limit) == _one_by_one(stack, a, b, names, limit)
            assert _exact(stack, a, b, limit) == _reference_exact(stack, a, b, limit)
    stack = _crafted(rng, 30)
    empty = np.zeros(0)
    assert [x.size for x in stack.top_keys(empty, empty)] == [0, 0, 0]


@pytest.mark.parametrize("trace_name", ["sglang_qwen3_8b_decode_bs32_mi300x", "hf_qwen1.5_0.5b_prefill_h100"])
def test_top_keys_on_a_public_trace(trace_name: str) -> None:
    trace = load_trace(PUBLIC / f"{trace_name}.json.gz")
    stacks = HostStacks(trace, trace.ranks[0])
    rng = np.random.default_rng(5)
    for tid in stacks.tids:
        stack = stacks.thread(tid)
        if stack.bounds.size < 2:
            continue
        lo, hi = float(stack.bounds[0]), float(stack.bounds[-1])
        a = np.concatenate([rng.uniform(lo, hi, 40), stack.bounds[rng.integers(0, stack.bounds.size, 10)]])
        b = a + rng.choice([10.0, 100.0, 1000.0, 20000.0], a.size)
        assert _batched(stack, a, b, trace.names, 5) == _one_by_one(stack, a, b, trace.names, 5)
        assert _exact(stack, a, b, 5) == _reference_exact(stack, a, b, 5)


def _summed_one_by_one(explainer: GapExplainer, tid: np.ndarray, members: np.ndarray, a: np.ndarray,
                       b: np.ndarray) -> list[dict[str, object]]:
    """top_frames' meaning: each gap's top(), its rounded self times summed over the gaps in order."""
    totals: dict[tuple[str, str], float] = {}
    for i in members.tolist():
        for frame in explainer.stacks.thread(int(tid[i])).top(float(a[i]), float(b[i]), explainer.names):
            key = (str(frame["name"]), str(frame["class"]))
            totals[key] = totals.get(key, 0.0) + float(frame["self_us"])  # type: ignore[arg-type]
    return [{"name": n, "class": c, "self_us": round(us, 1)} for (n, c), us in
            sorted(totals.items(), key=lambda kv: -kv[1])[:5]]


def test_top_frames_sums_each_gaps_top_frames() -> None:
    trace = load_trace(PUBLIC / "hf_qwen1.5_0.5b_prefill_h100.json.gz")
    stacks = HostStacks(trace, trace.ranks[0])
    explainer = GapExplainer(stacks)
    rng = np.random.default_rng(3)
    lo, hi = min(float(stacks.thread(t).bounds[0]) for t in stacks.tids), max(
        float(stacks.thread(t).bounds[-1]) for t in stacks.tids)
    a = rng.uniform(lo, hi, 200)
    b = a + rng.choice([5.0, 50.0, 500.0, 5000.0], a.size)
    tid = rng.choice(stacks.tids, a.size)  # gaps of one group read from different threads
    explained = Explained([""] * a.size, tid, np.full(a.size, -1), np.zeros((a.size, len(CLASSES))),
                          np.zeros((a.size, len(CLASSES))))
    groups = [rng.choice(a.size, size, replace=False) for size in (1, 2, 20, 20, 7)]
    assert explainer.top_frames(explained, groups, a, b) == [
        _summed_one_by_one(explainer, tid, g, a, b) for g in groups]
    assert explainer.top_frames(explained, [], a, b) == []


def test_nearest_of_several_stops_is_each_one_alone() -> None:
    """nesting.nearest with stops of shape (m, events) answers each row as a 1-D call does, and
    the 1-D call is the nearest stop up the parents (the root when none)."""
    trace = load_trace(PUBLIC / "sglang_qwen3_8b_decode_bs32_mi300x.json.gz")
    rows = HostStacks(trace, trace.ranks[0])._rows
    rows = max(rows.values(), key=lambda r: r.size)
    rows = rows[start_order(trace.ts[rows], trace.dur[rows])]
    parent = parents(trace.ts[rows], trace.ts[rows] + trace.dur[rows])
    by_depth = levels(depths(parent))
    rng = np.random.default_rng(1)
    stops = np.stack([rng.random(parent.size) < share for share in (0.0, 0.01, 0.5, 1.0)])
    together = nearest(parent, stops, by_depth)
    for stop, pointer in zip(stops, together, strict=True):
        assert nearest(parent, stop, by_depth).tolist() == pointer.tolist()
        want = []
        for k in range(parent.size):
            while not stop[k] and parent[k] >= 0:
                k = int(parent[k])
            want.append(k)
        assert pointer.tolist() == want
