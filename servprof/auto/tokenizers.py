"""tokenize / detokenize phases from the tokenizer libraries a server already loaded.

While a session runs, the entry points below are wrapped in their classes (only for
libraries already imported: servprof never imports one); at stop the originals are put
back. The outermost tokenizer call on a thread becomes one range
``servprof:auto.tokenize|<id>`` or ``servprof:auto.detokenize|<id>`` with the calling
request's id (nested calls, e.g. transformers' ``__call__`` -> ``tokenizers.Tokenizer.encode_batch``,
stay inside it). Whether it ran on the serving loop's thread is the range's thread id
against the session's ``event_loop_tid``.

Each outermost call of one text that takes 1 ms or more also leaves its thread's CPU time
(``timed``: thread id, start and wall ns on ``perf_counter_ns``, CPU ns): a tokenizer that is
slow works for all of its time, one whose thread waited (for the GIL, a CPU, I/O) does not.
A batch is not timed: its work runs on the library's pool threads, not on the caller's.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from time import perf_counter_ns, thread_time_ns
from typing import Any

from servprof.auto.context import request_id_here
from servprof.auto.emit import auto_phase_name, close_range, open_range

TOKENIZE, DETOKENIZE = "tokenize", "detokenize"
# library -> (module, class, {method: phase}); a library counts as present when its module is imported.
TARGETS: dict[str, tuple[str, str, dict[str, str]]] = {
    "tokenizers": ("tokenizers", "Tokenizer", {
        "encode": TOKENIZE, "encode_batch": TOKENIZE, "encode_batch_fast": TOKENIZE,
        "decode": DETOKENIZE, "decode_batch": DETOKENIZE}),
    "transformers": ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase", {
        "__call__": TOKENIZE, "encode": TOKENIZE, "encode_plus": TOKENIZE, "batch_encode_plus": TOKENIZE,
        "apply_chat_template": TOKENIZE, "tokenize": TOKENIZE, "decode": DETOKENIZE, "batch_decode": DETOKENIZE}),
    "tiktoken": ("tiktoken.core", "Encoding", {
        "encode": TOKENIZE, "encode_ordinary": TOKENIZE, "encode_batch": TOKENIZE,
        "encode_ordinary_batch": TOKENIZE, "decode": DETOKENIZE, "decode_bytes": DETOKENIZE,
        "decode_batch": DETOKENIZE}),
    "sentencepiece": ("sentencepiece", "SentencePieceProcessor", {
        "Encode": TOKENIZE, "EncodeAsIds": TOKENIZE, "EncodeAsPieces": TOKENIZE, "encode": TOKENIZE,
        "Decode": DETOKENIZE, "DecodeIds": DETOKENIZE, "DecodePieces": DETOKENIZE, "decode": DETOKENIZE}),
}


# Batch entry points of tokenizing (their work runs on the library's pool threads, not the caller's).
BATCH_METHODS = frozenset({"encode_batch", "encode_batch_fast", "batch_encode_plus", "encode_ordinary_batch"})
TIMED_MIN_NS = 1_000_000  # shorter calls are never judged (a stall needs 5 ms): not kept
MAX_TIMED = 256  # per session


def _one_text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's input is one text (or one chat), not a batch of them: ``args[0]`` is the
    tokenizer, the input its first argument (``text``, ``sequence`` or ``input`` by keyword)."""
    value = args[1] if len(args) > 1 else kwargs.get("text", kwargs.get("sequence", kwargs.get("input")))
    return not (isinstance(value, (list, tuple)) and value and isinstance(value[0], (str, list, tuple)))


class _Depth(threading.local):
    value = 0


def _classes(root: type) -> Iterator[type]:
    """``root`` and every subclass imported so far (transformers' tokenizer backends, model
    tokenizers that override ``decode``, a user's own subclass)."""
    seen: set[type] = set()
    stack = [root]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        stack.extend(cls.__subclasses__())


class TokenizerPatches:
    def __init__(self) -> None:
        self.active = False
        self._depth = _Depth()
        self._patched: list[tuple[type, str, Any, Any]] = []  # (class, name, original, wrapper)
        self.libraries: list[str] = []  # patched in the current / last session
        self.calls = {TOKENIZE: 0, DETOKENIZE: 0}
        self.timed: list[tuple[int, int, int, int]] = []  # (tid, start ns, wall ns, thread CPU ns)

    def install(self) -> list[str]:
        """Wrap what is importable now; returns the libraries found."""
        self.calls = {TOKENIZE: 0, DETOKENIZE: 0}
        self.timed = []
        self.active = True
        found = []
        for library, (module_name, class_name, methods) in TARGETS.items():
            module = sys.modules.get(module_name)
            root = getattr(module, class_name, None) if module is not None else None
            if not isinstance(root, type):
                continue
            found.append(library)
            for cls in _classes(root):
                wrappers: dict[int, Any] = {}  # one wrapper per function (sentencepiece aliases encode = Encode)
                for name, phase in methods.items():
                    original = cls.__dict__.get(name)
                    if original is None or not callable(original) or isinstance(original, (staticmethod, classmethod)):
                        continue
                    if getattr(original, "__servprof_original__", None) is not None:
                        continue  # already ours (a previous session's wrapper left under someone else's)
                    wrapper = wrappers.get(id(original)) or self._wrap(original, phase, name in BATCH_METHODS)
                    wrappers[id(original)] = wrapper
                    try:
                        setattr(cls, name, wrapper)
                    except (TypeError, AttributeError):  # an immutable extension type
                        continue
                    self._patched.append((cls, name, original, wrapper))
        self.libraries = found
        return found

    def remove(self) -> None:
        self.active = False
        patched, self._patched = self._patched, []
        for cls, name, original, wrapper in reversed(patched):
            # Someone who wrapped the method after us keeps their wrapper (ours passes through).
            if cls.__dict__.get(name) is wrapper:
                setattr(cls, name, original)

    def _wrap(self, original: Callable[..., Any], phase: str, batch: bool) -> Callable[..., Any]:
        depth = self._depth
        patches = self
        timed = phase == TOKENIZE and not batch

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not patches.active or depth.value:
                depth.value += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    depth.value -= 1
            request_id = request_id_here()
            handle = open_range(auto_phase_name(phase, [request_id] if request_id is not None else []))
            depth.value = 1
            patches.calls[phase] = patches.calls.get(phase, 0) + 1
            started, cpu = perf_counter_ns(), thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                cpu = thread_time_ns() - cpu  # (read inside the wall interval: never more than it)
                wall = perf_counter_ns() - started
                depth.value = 0
                close_range(handle)
                if timed and wall >= TIMED_MIN_NS and len(patches.timed) < MAX_TIMED and _one_text(args, kwargs):
                    patches.timed.append((threading.get_native_id(), started, wall, cpu))

        wrapper.__servprof_original__ = original  # type: ignore[attr-defined]
        return wrapper
