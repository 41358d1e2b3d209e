"""Interval arithmetic on numpy columns: unions and the holes between them."""

from __future__ import annotations

import numpy as np


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals as disjoint, sorted blocks (starts, ends)."""
    if starts.size == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    # A new block starts where an interval begins after everything before it ended.
    new_block = np.empty(s.size, dtype=bool)
    new_block[0] = True
    new_block[1:] = s[1:] > e[:-1]
    last = np.flatnonzero(np.append(new_block[1:], True))
    return s[new_block], e[last]


def intersect(s1: np.ndarray, e1: np.ndarray, s2: np.ndarray, e2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where two sets of disjoint, sorted intervals overlap, as disjoint, sorted intervals: each
    interval of the first against the second's that may overlap it (those ending after it starts
    and starting before it ends), never all pairs."""
    first = np.searchsorted(e2, s1, side="right")
    count = np.maximum(np.searchsorted(s2, e1, side="left") - first, 0)
    if not count.any():
        return np.zeros(0), np.zeros(0)
    one = np.repeat(np.arange(s1.size), count)
    two = np.arange(one.size) - np.repeat(np.cumsum(count) - count - first, count)
    start, end = np.maximum(s1[one], s2[two]), np.minimum(e1[one], e2[two])
    keep = end > start
    return start[keep], end[keep]


def starts_within(times: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For sorted times: how many fall in each window [a, b)."""
    return np.searchsorted(times, b, side="left") - np.searchsorted(times, a, side="left")


def inside_any(times: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For disjoint windows [starts, ends) sorted by start: whether each time falls in one."""
    at = np.searchsorted(starts, times, side="right") - 1
    return (at >= 0) & (times < ends[np.maximum(at, 0)]) if starts.size else np.zeros(times.shape, dtype=bool)


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    s, e = merge(starts, ends)
    return float(np.sum(e - s))


def covered(block_start: np.ndarray, block_end: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For disjoint sorted blocks: how much of each window [a, b] they cover (vectorised)."""
    if block_start.size == 0:
        return np.zeros(np.shape(a))
    cum = np.concatenate([[0.0], np.cumsum(block_end - block_start)])

    def before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(block_start, t, side="right") - 1
        j = np.maximum(i, 0)
        partial = np.clip(t - block_start[j], 0.0, block_end[j] - block_start[j])
        return np.where(i >= 0, cum[j] + partial, 0.0)

    return before(np.asarray(b, dtype=float)) - before(np.asarray(a, dtype=float))


def covered_within(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    """How much of [a, b] the intervals cover (overlaps counted once)."""
    block_start, block_end = merge(np.asarray(starts, dtype=float), np.asarray(ends, dtype=float))
    return float(covered(block_start, block_end, np.array([a]), np.array([b]))[0])


def outside(a: float, b: float, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[a, b] less the merged spans (starts, ends): the windows left, as two arrays."""
    inside = (ends > a) & (starts < b)
    cuts_start, cuts_end = starts[inside], ends[inside]
    lo = np.concatenate(([a], np.minimum(cuts_end, b)))
    hi = np.concatenate((np.maximum(cuts_start, a), [b]))
    keep = hi > lo
    return lo[keep], hi[keep]
