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


def test_no_names() -> None:
    for guarded in GUARDED.values():
        assert NameText([]).search(guarded).size == 0
