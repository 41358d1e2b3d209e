"""thread_groups (detect/threads.py) gives np.unique(axis=0)'s answer: same threads, same order,
same inverse, whether Python or numpy sorts them, on random columns (negative, large and repeated values) and on no rows."""

from __future__ import annotations

import numpy as np

from servprof.detect.threads import SMALL_ROWS, thread_groups


def _reference(rank: np.ndarray, pid: np.ndarray, tid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    threads, inverse = np.unique(np.stack([rank.astype(np.int64), pid, tid], axis=1), axis=0, return_inverse=True)
    return threads, inverse.ravel()


def test_matches_unique_rows() -> None:
    rng = np.random.default_rng(13)
    for size in (1, 2, 7, SMALL_ROWS, SMALL_ROWS + 1, 300, 5000):  # (Python's sort up to SMALL_ROWS, numpy's beyond)
        rank = rng.integers(0, 4, size).astype(np.int32)
        pid = rng.choice([-1, 0, 7, 2**40], size).astype(np.int64)
        tid = rng.choice([-(2**33), 3, 3, 11, 2**50], size).astype(np.int64)
        threads, inverse = thread_groups(rank, pid, tid)
        want_threads, want_inverse = _reference(rank, pid, tid)
        assert threads.tolist() == want_threads.tolist()
        assert inverse.tolist() == want_inverse.tolist()


def test_no_rows() -> None:
    empty = np.zeros(0, dtype=np.int64)
    threads, inverse = thread_groups(empty, empty, empty)
    assert threads.shape == (0, 3) and inverse.size == 0


def test_start_order_is_lexsort() -> None:
    """nesting.start_order gives np.lexsort((-dur, start)): ties in start (and NaNs) included."""
    from servprof.detect.nesting import start_order

    rng = np.random.default_rng(7)
    for size in (0, 1, 2, 50, 3000):
        for ties in (False, True):
            start = np.round(rng.random(size) * (5 if ties else 1e6), 0 if ties else 3)
            dur = np.round(rng.random(size) * 3, 0)
            if size > 5:
                start[rng.integers(0, size, 3)] = np.nan
                start = np.sort(start) if ties else start  # nearly sorted, as a thread's events come
            assert start_order(start, dur).tolist() == np.lexsort((-dur, start)).tolist()
