"""Suite-wide guard: torch.profiler is process-wide, and two profilers at once can crash
the process (docs/middleware.md). A test that leaves servprof's capture controller warming
up or in a session could collide with the next test's own profiler, so after every test
the controller, when one was made, is given time to become idle."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

SETTLE_TIMEOUT_S = 60.0
# servprof's cache (CPU calibration, demo tokenizer) is the suite's own, never the user's: a
# calibration saved in ~/.cache would change what the analyses in every later test judge against.
os.environ["SERVPROF_CACHE_DIR"] = tempfile.mkdtemp(prefix="servprof-test-cache-")
atexit.register(shutil.rmtree, os.environ["SERVPROF_CACHE_DIR"], True)
# torch on one intra-op thread, here and in the servers the tests start: on a shared 2-core
# machine another process's load turns each OpenMP barrier of a two-thread op into a stall of a
# scheduler slice (decode steps of 1 ms ran 16-30 ms with one busy process beside them, against
# 1-10 ms on one thread), which drowns the stalls the tests plant in the traces they analyse.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _servprof_capture_settles() -> Iterator[None]:
    yield
    capture = sys.modules.get("servprof.capture")
    controller = getattr(capture, "_controller", None) if capture is not None else None
    if controller is None:
        return
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while ((controller.warmup_wanted and not controller.warm) or controller.session is not None) \
            and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _forget_torch_compile() -> Iterator[None]:
    """servprof's automatic step hooks stay off in a process where torch.compile has compiled a
    frame (servprof.auto.compiled_model_present), and the compile probe reports every compile
    torch recorded since the process's first model request: a test that compiles must leave
    neither behind for the later tests of this one pytest process (in a server, one process is
    one server, and both are right)."""
    yield
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    from servprof.auto import compiled_model_present

    if compiled_model_present() or get_compilation_metrics():
        import torch._dynamo

        torch._dynamo.reset()
        counters.clear()
        clear_compilation_metrics()


@pytest.fixture(autouse=True)
def _forget_memory_history() -> None:
    """The memory probe keeps the process's levels between sessions (servprof.probes.memory): in a
    server the process is the server, but here it is every earlier test's, and their growth (models
    loaded, caches filled) is no leak of this test's server."""
    memory = sys.modules.get("servprof.probes.memory")
    if memory is not None:
        memory.memory_history().points.clear()


@pytest.fixture(autouse=True)
def _count_deep_windows_from_this_test() -> None:
    """A deep window follows every SERVPROF_DEEP_EVERY light sessions of the process-wide
    controller: each test counts from its own first session, not from the earlier tests'."""
    capture = sys.modules.get("servprof.capture")
    if capture is not None and capture._controller is not None:
        capture._controller.light_since_deep = 0
