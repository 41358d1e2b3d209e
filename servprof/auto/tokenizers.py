"""tokenize / detokenize phases from the tokenizer libraries a server already loaded.

While a session runs, the entry points below are wrapped in their classes (only for
libraries already imported: servprof never imports one); at stop the originals are put
back. The outermost tokenizer call on a thread becomes one range
``servprof:auto.tokenize|<id>`` or ``servprof:auto.detokenize|<id>`` with the calling
request's id (nested calls, e.g. transformers' ``__call__`` -> ``tokenizers.Tokenizer.encode_batch``,
stay inside it). Whether it ran on the serving loop's thread is the range's thread id
against the session's ``event_loop_tid``.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
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

    def install(self) -> list[str]:
        """Wrap what is importable now; returns the libraries found."""
        self.calls = {TOKENIZE: 0, DETOKENIZE: 0}
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
                    wrapper = wrappers.get(id(original)) or self._wrap(original, phase)
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

    def _wrap(self, original: Callable[..., Any], phase: str) -> Callable[..., Any]:
        depth = self._depth
        calls = self.calls
        patches = self

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
            calls[phase] = calls.get(phase, 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.value = 0
                close_range(handle)

        wrapper.__servprof_original__ = original  # type: ignore[attr-defined]
        return wrapper
