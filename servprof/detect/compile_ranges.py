"""The ranges torch.compile records on the host while it compiles or records a CUDA graph:
``entire_frame_compile``, ``backend_compile``, ``inductor_compile``, ``*(dynamo_timed)``
(every version since 2.1; cudagraph trees time ``CUDAGraphNode.record`` with it), and with
stacks the ``torch/_dynamo/convert_frame.py`` frames. Both the compile stalls (recompilation.py)
and the class of host time inside them (host_stacks.py: ``compiling``) are read from these.
"""

from __future__ import annotations

import re

from servprof.detect.name_guard import Guarded

STRONG_COMPILE_NAMES = frozenset({
    "entire_frame_compile", "_compile.compile_inner", "backend_compile", "inductor_compile", "compile_fx_inner",
    "OutputGraph.call_user_compiler", "create_aot_dispatcher_function", "fx_codegen_and_compile",
    "bytecode_tracing", "compile_attempt_0", "build_guards"})
WEAK_COMPILE_NAMES = frozenset({"dynamo"})  # counted only around a strong one (a common word)
DYNAMO_TIMED = " (dynamo_timed)"
PY_COMPILE_FRAME = re.compile(r"torch/_dynamo/convert_frame\.py\(\d+\): (?:_compile|compile_inner|__call__)$|"
                              r"torch/_inductor/compile_fx\.py\(\d+\): compile_fx(?:_inner)?$")
# The ranges torch's cudagraph trees time while recording a graph (torch/_inductor/cudagraph_trees.py).
CUDAGRAPH_RANGES = ("CUDAGraphNode.", "cudagraphify.")
# What every compile range's name holds (name_scan.py asks the predicate of those names only).
STRONG_LITERALS = (*sorted(STRONG_COMPILE_NAMES), DYNAMO_TIMED, "torch/_dynamo/convert_frame.py(",
                   "torch/_inductor/compile_fx.py(")
COMPILING_NAMES = Guarded(re.compile(
    r"\A(?:" + "|".join(re.escape(name) for name in sorted(STRONG_COMPILE_NAMES)) + r")\Z|"
    + re.escape(DYNAMO_TIMED) + r"\Z|" + PY_COMPILE_FRAME.pattern), *STRONG_LITERALS)


def is_compile_range(name: str) -> bool:
    """A range (or with stacks a frame) torch.compile records while compiling."""
    return COMPILING_NAMES.search(name) is not None
