"""A guarded regex (name_guard.Guarded) asked of many names at once.

Why: asking each distinct name of a trace one guard after another is a Python call per name and
guard (~1 µs, ten guards: most of NameClasses' time). Here the names are joined into one string
once, and every guard's literals are found in it in one pass (an Aho-Corasick automaton of them
all: ~5x faster than a str.find per literal, a hundred literals over a small trace's names);
only the names holding one of a guard's literals are given to its regex, exactly as
Guarded.search would. The answers are the regex's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import ahocorasick
import numpy as np

from servprof.detect.name_guard import LITERALS, Guarded

SEPARATOR = "\n"  # no guard literal holds it, so a literal found never spans two names


def _occurrences(text: str, literal: str) -> list[int]:
    """Where ``literal`` begins in ``text`` (str.find: a fast C search, ~10x a regex alternation's scan)."""
    found, find, pos = [], text.find, text.find(literal)
    while pos >= 0:
        found.append(pos)
        pos = find(literal, pos + 1)
    return found


_AUTOMATON: list[Any] = []  # [the automaton, the literals in it]


def literal_automaton() -> tuple[Any, frozenset[str]]:
    """An automaton of every guard's literals, lowered (name_guard.LITERALS), and those literals;
    made again when guards made since have added some (LITERALS only grows)."""
    if not _AUTOMATON or len(_AUTOMATON[1]) != len(LITERALS):
        automaton = ahocorasick.Automaton()
        for literal in LITERALS - {""}:  # ("": every name holds it; _occurrences says so)
            automaton.add_word(literal, literal)
        automaton.make_automaton()
        _AUTOMATON[:] = [automaton, frozenset(LITERALS - {""})]
    return _AUTOMATON[0], _AUTOMATON[1]


class NameText:
    """Names joined into one string, with where each begins."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.text = SEPARATOR.join(names)
        lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names)) + len(SEPARATOR)
        self.starts = np.cumsum(lengths) - lengths
        self._folded: str | None = None
        self._not_ascii: np.ndarray | None = None
        self._holders: dict[str, np.ndarray] | None = None
        self._scanned: frozenset[str] = frozenset()
        self._searched: dict[Guarded, np.ndarray] = {}  # (Guarded hashes by identity)

    def _folded_text(self) -> tuple[str, np.ndarray]:
        """ASCII names lowered (what Guarded compares its lower-case literals with); other names
        as they are -- they always go to the regex -- so every name keeps its offsets."""
        if self._folded is None or self._not_ascii is None:
            ascii_ = [name.isascii() for name in self.names]
            self._folded = SEPARATOR.join(n.lower() if a else n for n, a in zip(self.names, ascii_, strict=True))
            self._not_ascii = ~np.array(ascii_, dtype=bool)
        return self._folded, self._not_ascii

    def _literal_holders(self) -> tuple[dict[str, np.ndarray], frozenset[str]]:
        """Per guard literal (lowered) found in the folded text: the names holding it; and the
        literals looked for (one automaton pass, the first time a guard is asked)."""
        if self._holders is None:
            automaton, self._scanned = literal_automaton()
            hits = list(automaton.iter(self._folded_text()[0])) if self._scanned else []
            holders: dict[str, list[int]] = {}
            for (_, literal), name in zip(hits, self._name_at([end for end, _ in hits]).tolist(), strict=True):
                holders.setdefault(literal, []).append(name)
            self._holders = {literal: np.array(names, dtype=np.int64) for literal, names in holders.items()}
        return self._holders, self._scanned

    def _name_at(self, positions: list[int]) -> np.ndarray:
        """The name each text position falls in."""
        return np.searchsorted(self.starts, np.array(positions, dtype=np.int64), side="right") - 1

    def candidates(self, guarded: Guarded) -> np.ndarray:
        """Per name: does it hold one of the guard's literals, case aside (a case-sensitive
        guard's regex then decides), or is it a non-ASCII name (the folded text keeps those as
        they are)? The names Guarded hands to its regex, and perhaps a few more."""
        out = np.zeros(len(self.names), dtype=bool)
        if not self.names:
            return out
        text, not_ascii = self._folded_text()
        out |= not_ascii
        holders, scanned = self._literal_holders()
        for literal in guarded.literals:
            key = literal.lower()
            found = holders.get(key) if key in scanned else self._name_at(_occurrences(text, key))
            if found is not None:
                out[found] = True
        return out

    def _mark_holders(self, out: np.ndarray, text: str, literals: tuple[str, ...]) -> None:
        """Set ``out`` where a name of ``text`` (this NameText's layout) holds one of ``literals``."""
        found = [pos for literal in literals for pos in _occurrences(text, literal)]
        if found:
            out[np.searchsorted(self.starts, np.array(found, dtype=np.int64), side="right") - 1] = True

    def starting_with(self, prefix: str) -> np.ndarray:
        """Per name: ``name.startswith(prefix)``. A name begins at its offset in the joined text,
        so str.find of the prefix there answers every name at once (exact while the prefix holds
        no separator: a match at a name's offset then never runs past its end)."""
        if SEPARATOR in prefix or not prefix:
            return np.fromiter((n.startswith(prefix) for n in self.names), dtype=bool, count=len(self.names))
        out = np.zeros(len(self.names), dtype=bool)
        found = np.array(_occurrences(self.text, prefix), dtype=np.int64)
        if found.size:
            i = np.searchsorted(self.starts, found, side="right") - 1
            out[i[self.starts[i] == found]] = True
        return out

    def holding(self, literals: tuple[str, ...], predicate: Callable[[str], bool]) -> np.ndarray:
        """Per name: ``predicate(name)``, asked only of the names holding one of ``literals`` (the
        others: False). Exact when every name the predicate holds for holds one of them."""
        out = np.zeros(len(self.names), dtype=bool)
        self._mark_holders(out, self.text, literals)
        names = self.names
        for i in np.flatnonzero(out).tolist():
            out[i] = predicate(names[i])
        return out

    def search(self, guarded: Guarded) -> np.ndarray:
        """Per name: ``guarded.search(name) is not None`` (a new array each call). Asked once per
        guard: the step forms, NameClasses and the detectors ask some of the same guards."""
        out = self._searched.get(guarded)
        if out is None:
            out = self.candidates(guarded)
            search, names = guarded.pattern.search, self.names
            for i in np.flatnonzero(out).tolist():
                out[i] = search(names[i]) is not None
            self._searched[guarded] = out
        return out.copy()


# One NameText of a trace's host-event names, shared by the detectors that ask guards of them
# (NameClasses, the step forms, tokenization); weakly keyed: it goes with its trace.
_HOST_TEXTS: WeakKeyDictionary[Any, tuple[np.ndarray, NameText]] = WeakKeyDictionary()


def host_name_text(trace: Any) -> tuple[np.ndarray, NameText]:
    """(trace.host_names(), a NameText of those names), made once per trace."""
    cached = _HOST_TEXTS.get(trace)
    if cached is None:
        ids = trace.host_names()
        cached = _HOST_TEXTS[trace] = (ids, NameText([trace.names[i] for i in ids.tolist()]))
    return cached


_ALL_TEXTS: WeakKeyDictionary[Any, NameText] = WeakKeyDictionary()


def all_name_text(trace: Any) -> NameText:
    """A NameText of every interned string of the trace (names and categories), made once per trace."""
    text = _ALL_TEXTS.get(trace)
    if text is None:
        text = _ALL_TEXTS[trace] = NameText(trace.names)
    return text


def ids_holding(trace: Any, literals: tuple[str, ...], predicate: Callable[[str], bool]) -> np.ndarray:
    """trace.ids_matching(predicate): over every string, when every string predicate holds for
    holds one of ``literals``."""
    return np.flatnonzero(all_name_text(trace).holding(literals, predicate))


def host_ids_matching(trace: Any, guarded: Guarded) -> np.ndarray:
    """trace.ids_matching(guarded.search, trace.host_names()), from the shared NameText."""
    ids, text = host_name_text(trace)
    return ids[text.search(guarded)]
