"""How one thread's recorded events nest, and which one it was in at every instant, as array
operations (a trace has millions of host events: no Python step per event).

The events, sorted by start (the longer first at equal starts), are swept as a stack: before
an event is pushed, the events on top that ended by its start are popped; one that outlives
the event below it (µs rounding, or ranges that do not nest) makes that one last as long, so
that at every instant the innermost event open is on top. Here the same stack is read off
without sweeping:

- the **parent** of event k (the top when k is pushed) is the last event j < k whose own end
  is after k's start: one still open then was extended to at least its children's ends, so
  only its own end can have closed it before, and every event between it and k has closed;
- an event's **extended end** is the latest end in its subtree;
- an event is popped on the turn of the first event that starts at or after its extended end
  (innermost first); between two consecutive pushes or pops the thread is in the event on top.
"""

from __future__ import annotations

import numpy as np


def parents(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per event (sorted by start): the index of the event it is inside, -1 at the top level.

    The last j < k with end[j] > start[k], by pointer jumping: when candidate c ended by
    start[k], so did every event between c's own candidate and c (they ended by
    start[c] <= start[k]), so the search for k goes on from c's candidate."""
    n = start.size
    candidate = np.arange(-1, n - 1, dtype=np.int64)
    searching = np.arange(1, n, dtype=np.int64)
    while searching.size:
        searching = searching[end[candidate[searching]] <= start[searching]]
        candidate[searching] = candidate[candidate[searching]]
        searching = searching[candidate[searching] >= 0]
    return candidate


def depths(parent: np.ndarray) -> np.ndarray:
    """Per event: how many events it is inside (Wyllie's list ranking up the parents)."""
    depth = (parent >= 0).astype(np.int64)
    up = parent.copy()
    climbing = np.flatnonzero(up >= 0)
    while climbing.size:
        above = up[climbing]
        depth[climbing] += depth[above]
        up[climbing] = up[above]
        climbing = climbing[up[climbing] >= 0]
    return depth


def extended_ends(end: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Per event: the latest end in its subtree (children first, one depth level at a time)."""
    extended = end.copy()
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max(initial=0)) + 2))
    for level in range(bounds.size - 2, 0, -1):
        children = order[bounds[level]:bounds[level + 1]]
        np.maximum.at(extended, parent[children], extended[children])
    return extended


def nearest(parent: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Per event: the nearest event, itself or an ancestor, where ``stop`` holds (the root of its
    tree when none does), by pointer doubling."""
    pointer = np.where(stop | (parent < 0), np.arange(parent.size), parent)
    while True:
        further = pointer[pointer]
        if np.array_equal(further, pointer):
            return pointer
        pointer = further


def segments(start: np.ndarray, extended: np.ndarray, parent: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, event) of the disjoint stretches of time the thread spent in each event
    (its self time), in time order; stretches of no length are left out."""
    n = start.size
    if n == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    index = np.arange(n, dtype=np.int64)
    # Event j is popped on the turn of the first event after it that starts at or after its end.
    popped = np.maximum(np.searchsorted(start, extended, side="left"), index + 1)
    # One key per push (turn k, after its pops) and pop (turn, innermost = highest index first).
    key = np.concatenate([index * (2 * n + 2) + (n + 1), popped * (2 * n + 2) + (n - index)])
    order = np.argsort(key, kind="stable")
    del key
    is_push = order < n
    event = np.where(is_push, order, order - n)
    time = np.where(is_push, start[event], extended[event])
    # On top after each push: the event pushed; after a pop: the event below it.
    top = np.where(is_push, event, parent[event])
    keep = (time[1:] > time[:-1]) & (top[:-1] >= 0)
    return time[:-1][keep], time[1:][keep], top[:-1][keep]
