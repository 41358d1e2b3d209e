"""The C heap of a process that analyses traces (glibc's malloc; a no-op elsewhere).

Two opposite needs, each where it applies:

- A big file's pieces must go back to the OS once joined (give_back_freed_memory), or the RSS
  would count the columns twice.
- A process that analyses trace after trace (the analysis worker, `servprof analyze` over a
  folder) should keep its freed buffers for the next trace. glibc returns a freed block of more
  than 128 KiB (a batch's text, a read chunk) to the OS and takes it back with fresh pages at
  the next trace, each page zeroed on first touch: measured on a 2-core VM, ~260 such page faults
  (~0.7 ms, a tenth of the run) per analysis of a 2,000-event trace, and none once blocks up to
  a few MiB stay in the heap (keep_freed_memory_for_reuse). Only the analysing processes ask for
  it: a serving process keeps its allocator as it was.
"""

from __future__ import annotations

from typing import Any

# Blocks up to this size come from the heap (bigger ones, a big trace's whole columns, are still
# mapped on their own and returned whole when freed); and the heap keeps at most this much free
# at its top rather than giving it back.
HEAP_BLOCK_BYTES = 4 * 1024**2
HEAP_SLACK_BYTES = 8 * 1024**2
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # (malloc.h)

_libc: Any = None


def _glibc() -> Any:
    """libc's malloc_trim and mallopt, or False where they are not (musl, macOS, Windows)."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            libc = ctypes.CDLL(None)
            _libc = libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else False
        except OSError:
            _libc = False
    return _libc


def give_back_freed_memory() -> None:
    """Return freed heap memory to the OS. glibc keeps the pages of freed blocks inside its heap,
    and the RSS counts them: without this, a file's batch pieces would still count after being
    joined into whole columns, and the peak would be the columns twice."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)


def keep_freed_memory_for_reuse() -> bool:
    """Keep freed blocks of up to HEAP_BLOCK_BYTES in the heap for the next trace (see above);
    for processes that only analyse. Returns whether the allocator took the settings."""
    libc = _glibc()
    if not libc:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, HEAP_SLACK_BYTES))
