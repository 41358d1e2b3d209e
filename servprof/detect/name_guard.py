"""Regular expressions over event names, tried only on the names that could match.

Why: the detectors classify every distinct name of a trace with a dozen alternations (sync calls,
tokenizers, collectives ...). Python's regex engine tries each alternative at each position of
the name: ~1-3 µs a name and pattern, a third of a small trace's detectors. Every match of those
patterns contains one of a few literal substrings, and a substring test is ~10x cheaper, so a
name that holds none of them is answered without the regex. The answer is the regex's own either
way (tests/test_name_guard.py checks the literals against every fixture's names).
"""

from __future__ import annotations

import re

# Every literal of every guard made, lowered: name_scan finds them all in one pass over a trace's names.
LITERALS: set[str] = set()


class Guarded:
    """``pattern``'s ``search`` / ``match``, skipped (None) for a name holding none of ``literals``.

    Every match of ``pattern`` must contain one of ``literals``. With re.IGNORECASE the literals
    are lower case and tested on the lowered name, for ASCII names only (lowering is then exactly
    the regex's case folding); other names go to the regex."""

    __slots__ = ("pattern", "literals", "fold")

    def __init__(self, pattern: re.Pattern[str], *literals: str) -> None:
        self.pattern = pattern
        self.fold = bool(pattern.flags & re.IGNORECASE)
        if self.fold and any(lit != lit.lower() for lit in literals):
            raise ValueError("literals of a case-insensitive pattern must be lower case")
        self.literals = literals
        LITERALS.update(literal.lower() for literal in literals)

    def _may_match(self, name: str) -> bool:
        if self.fold:
            if not name.isascii():
                return True
            name = name.lower()
        for literal in self.literals:  # noqa: SIM110 - a loop: cheaper than any() over a generator
            if literal in name:
                return True
        return False

    def search(self, name: str) -> re.Match[str] | None:
        return self.pattern.search(name) if self._may_match(name) else None

    def match(self, name: str) -> re.Match[str] | None:
        return self.pattern.match(name) if self._may_match(name) else None
