"""NameText (detect/name_scan.py) answers every guard as Guarded.search does, name by name: on
every fixture trace's names, the crafted names, names holding the separator, non-ASCII names, and
each name alone or in any company (one NameText per list, nothing shared between lists)."""

from __future__ import annotations

import random

import pytest
from test_name_guard import CRAFTED, GUARDED, _names

from servprof.detect.name_scan import NameText


@pytest.fixture(scope="module")
def names() -> list[str]:
    return _names() + ["\n", "a\nb", "\n\n", "ÀTOKENIZE\nsync", "\ncudaStreamSynchronize\n"]


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_scan_answers_as_the_guard(name: str, names: list[str]) -> None:
    guarded = GUARDED[name]
    text = NameText(names)
    assert text.search(guarded).tolist() == [guarded.search(n) is not None for n in names]


def test_any_company_and_order(names: list[str]) -> None:
    rng = random.Random(13)
    for _ in range(20):
        subset = rng.sample(names, k=rng.randint(0, 40)) + rng.sample(CRAFTED, k=5)
        text = NameText(subset)
        for guarded in GUARDED.values():
            assert text.search(guarded).tolist() == [guarded.search(n) is not None for n in subset]


def test_guards_the_automaton_was_not_built_with() -> None:
    """The literals are found in one automaton pass (made from every guard made so far): a guard
    made after a NameText scanned, a case-sensitive literal in a non-ASCII name (the folded text
    keeps those names as they are), and an empty literal are each answered as the guard does."""
    import re

    from servprof.detect.name_guard import Guarded

    names = ["cudaLaunchKernel", "ÀcudaLaunchKernel", "launchpad", "LAUNCH", "Élan", "x"]
    text = NameText(names)
    for guarded in GUARDED.values():  # the automaton scans before the new guards exist
        text.search(guarded)
    late = [Guarded(re.compile(r"LaunchKernel"), "LaunchKernel"),  # upper case, a non-ASCII holder
            Guarded(re.compile(r"élan", re.IGNORECASE), "élan"),  # a non-ASCII literal
            Guarded(re.compile(r"pad|^x$"), "pad", "x"),
            Guarded(re.compile(r"^"), "")]  # every name
    for guarded in late:
        for scanner in (text, NameText(names)):  # (scanned before the guard, and after it)
            assert scanner.search(guarded).tolist() == [guarded.search(n) is not None for n in names], \
                guarded.pattern


def test_no_names() -> None:
    for guarded in GUARDED.values():
        assert NameText([]).search(guarded).size == 0


def test_host_name_text_is_each_traces_own() -> None:
    """The shared NameText of a trace's host names: one per trace, never another trace's, and the
    ids it matches are those ids_matching finds, for two traces analysed in one process."""
    import gc
    from pathlib import Path

    from servprof.detect.host_classes import SYNC_NAMES
    from servprof.detect.name_scan import _HOST_TEXTS, host_ids_matching, host_name_text
    from servprof.trace import load_trace

    fixtures = Path(__file__).parent / "fixtures"
    first = load_trace(fixtures / "public" / "hta_cuda_event_sync_a100.json.gz")
    second = load_trace(fixtures / "demo_sync_per_step.json.gz")
    for trace in (first, second, first):
        ids, text = host_name_text(trace)
        assert host_name_text(trace)[1] is text  # made once per trace
        assert text.names == [trace.names[i] for i in trace.host_names().tolist()]
        want = trace.ids_matching(lambda s: SYNC_NAMES.search(s) is not None, trace.host_names())
        assert host_ids_matching(trace, SYNC_NAMES).tolist() == want.tolist()
    assert host_name_text(first)[1] is not host_name_text(second)[1]
    held = len(_HOST_TEXTS)
    del first, trace
    gc.collect()
    assert len(_HOST_TEXTS) == held - 1 and second in _HOST_TEXTS  # the cache goes with its trace


def test_name_classes_as_name_by_name() -> None:
    """NameClasses (every guard asked of all names at once) gives each name what the per-name
    rules give: its class (_class_of_name), and whether it is an annotation."""
    from pathlib import Path

    from servprof.detect.host_classes import NameClasses, _class_of_name
    from servprof.detect.step_forms import is_step_annotation
    from servprof.trace import load_trace
    from servprof.trace.phases import PHASE_PREFIX

    fixtures = Path(__file__).parent / "fixtures"
    for path in sorted((fixtures / "public").glob("*.json.gz")) + sorted(fixtures.glob("*.json.gz")):
        trace = load_trace(path)
        classes = NameClasses(trace)
        host = trace.host_names().tolist()
        names = [trace.names[i] for i in host]
        assert classes.specific[host].tolist() == [_class_of_name(n) for n in names], path.name
        assert classes.annotation[host].tolist() == [n.startswith(PHASE_PREFIX) or is_step_annotation(n)
                                                     for n in names], path.name


def test_ids_holding_as_ids_matching() -> None:
    """The recompilation and bandwidth detectors' name questions, asked through the shared
    NameText of every string, give ids_matching's ids on every fixture."""
    from pathlib import Path

    from servprof.detect import compile_ranges as cr
    from servprof.detect import recompilation as rc
    from servprof.detect.name_scan import host_name_text, ids_holding
    from servprof.trace import load_trace

    def strong(s: str) -> bool:  # the compile ranges' definition, written plainly
        return s in cr.STRONG_COMPILE_NAMES or s.endswith(cr.DYNAMO_TIMED) or cr.PY_COMPILE_FRAME.search(s) is not None

    def region(s: str) -> bool:
        return rc.REGION.match(s) is not None

    crafted = ["backend_compile", "xbackend_compile", "f (dynamo_timed)", "torch/_dynamo/convert_frame.py(9): _compile",
               "Torch-Compiled Region: 0/1", "x Torch-Compiled Region: 0/1", "cudaGraphLaunch",
               "backend_compile\n", "f (dynamo_timed)\n", "CUDAGraphNode.record (dynamo_timed)"]
    fixtures = Path(__file__).parent / "fixtures"
    for path in sorted((fixtures / "public").glob("*.json.gz")) + sorted(fixtures.glob("*.json.gz")):
        trace = load_trace(path)
        trace.names.extend(crafted)  # (strings no event uses: ids_matching over all strings still sees them)
        assert ids_holding(trace, (rc.REGION_LITERAL,), region).tolist() == trace.ids_matching(region).tolist()
        assert ids_holding(trace, ("GraphLaunch",), lambda s: True).tolist() == \
            trace.ids_matching(lambda s: "GraphLaunch" in s).tolist()
        ids, text = host_name_text(trace)
        assert ids[text.holding(cr.STRONG_LITERALS, strong)].tolist() == trace.ids_matching(strong, ids).tolist()
        # The one guarded regex (host_stacks' compiling class) answers as the plain definition.
        assert all(cr.is_compile_range(name) == strong(name) for name in trace.names)


def test_starting_with_as_startswith(names: list[str]) -> None:
    """NameText.starting_with(prefix) is str.startswith name by name: prefixes longer than some
    names, found inside names (not at their start), holding the separator, and empty."""
    rng = random.Random(5)
    extra = ["servprof:", "servprof", "xservprof:tokenize", "servprof:tokenize|r1", "a\nservprof:x", "", "s"]
    for subset in (names + extra, extra, [], rng.sample(names, k=30) + extra[::-1]):
        text = NameText(subset)
        for prefix in ("servprof:", "s", "<built-in", "a\nservprof", "\n", "", "servprof:tokenize|r1x"):
            assert text.starting_with(prefix).tolist() == [n.startswith(prefix) for n in subset], prefix


def test_a_guard_asked_again_gives_a_fresh_equal_answer(names: list[str]) -> None:
    text = NameText(names)
    for guarded in GUARDED.values():
        first = text.search(guarded)
        want = first.tolist()
        first[:] = ~first  # a caller's changes never reach the next caller
        assert text.search(guarded).tolist() == want == [guarded.search(n) is not None for n in names]


def test_blocking_c_calls_are_waits() -> None:
    """C calls that block with the GIL released, as Python's profiler names them (address stripped),
    are waits: an idle executor worker (concurrent.futures, asyncio.to_thread) is not computing,
    and never read as holding the GIL."""
    from servprof.detect.host_classes import CLASSES, WAIT, _class_of_name

    for name in ("<built-in method get of _queue.SimpleQueue object>", "<method 'get' of '_queue.SimpleQueue' objects>",
                 "<built-in function waitpid>", "<built-in function select>", "<built-in function sleep>",
                 "<built-in method acquire of _thread.lock object>"):
        assert CLASSES[_class_of_name(name)] == CLASSES[WAIT], name
    for name in ("<built-in method get of dict object>", "<built-in method sub of re.Pattern object>"):
        assert _class_of_name(name) != WAIT, name
