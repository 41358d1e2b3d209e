"""thread_groups (detect/threads.py) gives np.unique(axis=0)'s answer: same threads, same order,
same inverse, on random columns (negative, large and repeated values) and on no rows."""

from __future__ import annotations

import numpy as np

from servprof.detect.threads import thread_groups


def _reference(rank: np.ndarray, pid: np.ndarray, tid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    threads, inverse = np.unique(np.stack([rank.astype(np.int64), pid, tid], axis=1), axis=0, return_inverse=True)
    return threads, inverse.ravel()


def test_matches_unique_rows() -> None:
    rng = np.random.default_rng(13)
    for size in (1, 2, 7, 300, 5000):
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
