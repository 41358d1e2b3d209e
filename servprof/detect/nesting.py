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
- an event is popped on the turn of the first event that starts at or after its extended end,
  innermost first, before that event is pushed; between two consecutive pushes or pops the
  thread is in the event on top.

Indices are int32 (a thread of 2^31 events is far past any trace servprof reads): memory
stays a few tens of bytes per event.
"""

from __future__ import annotations

import numpy as np

INDEX = np.int32


def start_order(start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """``np.lexsort((-dur, start))``: by start, the longer first at equal starts, then in index
    order. Why: lexsort sorts by the shuffled durations first (~3 ms for 20,000 events); a thread's
    events come nearly in start order, which a stable sort by start takes in ~0.05 ms, and only
    the runs of equal starts need the durations."""
    order = np.argsort(start, kind="stable")
    ordered = start[order]
    tied = ordered[1:] == ordered[:-1]
    tied |= np.isnan(ordered[1:]) & np.isnan(ordered[:-1])  # (sorts treat NaNs as equal)
    if not tied.any():
        return order
    in_run = np.zeros(order.size, dtype=bool)
    in_run[1:] |= tied
    in_run[:-1] |= tied
    # The runs keep their places; within them (already by start, then index), the durations.
    run = order[in_run]
    order[in_run] = run[np.lexsort((-dur[run], start[run]))]
    return order


TABLE_EVENTS = 1 << 16  # up to this many events, parents() searches a table of maxima (8.5 MiB at most)


def parents(start: np.ndarray, end: np.ndarray, closed: bool = False) -> np.ndarray:
    """Per event (sorted by start): the index of the event it is inside, -1 at the top level: the
    last j < k with end[j] > start[k] (>= when ``closed``: an event still holds what starts at its
    end). Two searches give the same answer: a table of maxima (log2(n) passes, whatever the
    nesting) up to TABLE_EVENTS events, pointer jumping (memory linear in events) beyond."""
    if start.size <= TABLE_EVENTS:
        return _parents_by_table(start, end, closed)
    return _parents_by_jumping(start, end, closed)


def _parents_by_table(start: np.ndarray, end: np.ndarray, closed: bool) -> np.ndarray:
    """maxima[l][i] is the latest end among events i-2^l+1 .. i (from 0 near the start). Going
    back from k-1, the events that ended by start[k] form a run, which a block whose latest end
    is not after start[k] lies inside: the run is skipped block by block, largest first, each size
    tried once (its length's binary digits). A NaN end is never ended (as a comparison says)."""
    n = start.size
    maxima = [end]
    width = 1
    while 2 * width <= n:
        block = maxima[-1].copy()
        np.maximum(block[width:], maxima[-1][:-width], out=block[width:])
        maxima.append(block)
        width *= 2
    ended = np.less if closed else np.less_equal
    at = np.arange(-1, n - 1, dtype=INDEX)  # where each event's search stands
    for level in range(len(maxima) - 1, -1, -1):
        skip = ended(maxima[level][np.maximum(at, 0)], start)
        skip &= at >= 0
        at[skip] -= 1 << level
    return np.maximum(at, -1, out=at)


def _parents_by_jumping(start: np.ndarray, end: np.ndarray, closed: bool) -> np.ndarray:
    """When candidate c ended by start[k], so did every event between c's own candidate and c
    (they ended by start[c] <= start[k]), so the search for k goes on from c's candidate."""
    n = start.size
    candidate = np.arange(-1, n - 1, dtype=INDEX)
    searching = np.arange(1, n, dtype=INDEX)
    ended = np.less if closed else np.less_equal
    while searching.size:
        searching = searching[ended(end[candidate[searching]], start[searching])]
        candidate[searching] = candidate[candidate[searching]]
        searching = searching[candidate[searching] >= 0]
    return candidate


def open_at(start: np.ndarray, end: np.ndarray, times: np.ndarray) -> np.ndarray:
    """For each time: the index of the last event (sorted by start) that started at or before it
    and had not ended before it, -1 when none: the innermost event open then, for a stack that
    pops an event once a later one starts after its end. Each time is an event of no length put
    after those that start by then, and its parent is the answer."""
    n, m = start.size, times.size
    order = np.lexsort((np.arange(n + m), np.repeat([0, 1], [n, m]), np.concatenate([start, times])))
    parent = parents(np.concatenate([start, times])[order],
                     np.concatenate([end, np.full(m, -np.inf)])[order], closed=True)  # (a time holds nothing)
    place = np.empty(n + m, dtype=np.int64)
    place[order] = np.arange(n + m)
    found = parent[place[n:]]
    return np.where(found >= 0, order[np.maximum(found, 0)], -1)


def depths(parent: np.ndarray) -> np.ndarray:
    """Per event: how many events it is inside (Wyllie's list ranking up the parents)."""
    depth = (parent >= 0).astype(INDEX)
    up = parent.copy()
    climbing = np.arange(parent.size, dtype=INDEX)[up >= 0]
    while climbing.size:
        above = up[climbing]
        depth[climbing] += depth[above]
        up[climbing] = up[above]
        climbing = climbing[up[climbing] >= 0]
    return depth


Levels = tuple[np.ndarray, list[int]]  # events by depth, and where each depth begins (levels())


def levels(depth: np.ndarray) -> Levels:
    """The events ordered by depth (in index order within one): ``order[bounds[d]:bounds[d + 1]]``
    are those at depth d."""
    return np.argsort(depth, kind="stable").astype(INDEX), [0, *np.cumsum(np.bincount(depth)).tolist()]


def extend_ends(end: np.ndarray, parent: np.ndarray, by_depth: Levels) -> None:
    """Make each event's end the latest end in its subtree (children first, one depth level at
    a time), in place."""
    order, bounds = by_depth
    for level in range(len(bounds) - 2, 0, -1):
        children = order[bounds[level]:bounds[level + 1]]
        np.maximum.at(end, parent[children], end[children])


def nearest(parent: np.ndarray, stop: np.ndarray, by_depth: Levels) -> np.ndarray:
    """Per event: the nearest event, itself or an ancestor, where ``stop`` holds (the root of its
    tree when none does). ``stop`` of shape (m, events): m such questions at once. Each event
    points at itself where it stops (or is a root), else at its parent; following the pointers
    twice as far each round (pointer doubling) reaches the answer in log2(depth) rounds, as
    gathers over all events (a loop over the depth levels costs numpy calls per level)."""
    n = parent.size
    dtype = INDEX if stop.size < 2**31 else np.int64
    pointer = np.where(stop | (parent < 0), np.arange(n, dtype=dtype), parent).astype(dtype, copy=False)
    # Rows as one flat array: row r's pointers are offset by r * n (one gather per round for all).
    offset = (np.arange(stop.shape[0], dtype=dtype) * n)[:, None] if stop.ndim > 1 else 0
    flat = (pointer + offset).reshape(-1)
    for _ in range((len(by_depth[1]) - 2).bit_length()):  # (2^rounds > the deepest event's depth)
        flat = flat[flat]
    pointer = flat.reshape(stop.shape)
    pointer -= offset
    return pointer


def segments(start: np.ndarray, extended: np.ndarray, parent: np.ndarray, depth: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """The thread's time cut where the event on top changes: (bounds, event), segment i being
    [bounds[i], bounds[i + 1]), spent in event[i] (its self time), or in none (-1: a hole
    between top-level events)."""
    n = start.size
    if n == 0:
        return np.zeros(0), np.zeros(0, dtype=INDEX)
    # Event j is popped on the turn of the first event after it that starts at or after its end.
    turn = np.searchsorted(start, extended, side="left").astype(INDEX)
    np.maximum(turn, np.arange(1, n + 1, dtype=INDEX), out=turn)
    pops = np.bincount(turn, minlength=n + 1).astype(INDEX)
    # Turn t takes the places after t pushes and the pops of earlier turns: its pops, innermost
    # first (those of one turn are the top of the stack, one per depth), then its push.
    first = np.cumsum(pops, dtype=INDEX)
    first -= pops
    first += np.arange(n + 1, dtype=INDEX)
    innermost = np.zeros(n + 1, dtype=INDEX)
    np.maximum.at(innermost, turn, depth)
    place = first[turn]
    place += innermost[turn]
    place -= depth
    del turn, innermost
    time = np.empty(2 * n)
    top = np.empty(2 * n, dtype=INDEX)
    time[place] = extended
    top[place] = parent  # after a pop, the event below it is on top
    place = first[:n]
    place += pops[:n]
    del first, pops
    time[place] = start
    top[place] = np.arange(n, dtype=INDEX)
    del place
    # A segment begins at each push or pop after which time moves on: what is on top then.
    moves = np.append(time[1:] > time[:-1], True)
    event = top[moves][:-1]
    del top
    return time[moves], event
