"""Writes the demo tokenizer's training text (servprof/demo/data/corpus.txt).

The text is generated here from word lists and sentence shapes, so it is ours to
ship: varied English-like prose, dialogue, lists, numbers and a little code, which
is what a byte-level BPE needs to learn realistic merges. Regenerate with
``python -m servprof.demo.corpus`` (deterministic for a given seed).
"""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = [
    "the engineer",
    "a small team",
    "the server",
    "our model",
    "the scheduler",
    "every request",
    "the old library",
    "a curious student",
    "the night shift",
    "the weather station",
    "my neighbour",
    "the river",
    "a quiet village",
    "the market",
    "the orchestra",
    "the committee",
    "a tired runner",
    "the garden",
    "the ship's captain",
    "the baker",
    "a stray cat",
    "the museum",
    "the new intern",
    "the compiler",
    "the database",
    "a distant star",
    "the city council",
    "the kitchen",
]
VERBS = [
    "measured",
    "rebuilt",
    "watched",
    "forgot",
    "explained",
    "painted",
    "carried",
    "sorted",
    "tested",
    "shipped",
    "counted",
    "answered",
    "repaired",
    "questioned",
    "followed",
    "planted",
    "borrowed",
    "described",
    "collected",
    "scheduled",
    "compressed",
    "translated",
    "recorded",
    "ignored",
    "opened",
]
OBJECTS = [
    "the long report",
    "three red boxes",
    "a handful of seeds",
    "the latency graph",
    "every window",
    "the broken clock",
    "a map of the harbour",
    "the morning queue",
    "forty small tokens",
    "the bridge",
    "a warm loaf of bread",
    "the cache",
    "an unfinished letter",
    "the weekly budget",
    "the old piano",
    "a list of questions",
    "the spare keys",
    "the memory budget",
    "a pile of leaves",
    "the evening news",
]
PLACES = [
    "near the station",
    "after lunch",
    "before the storm",
    "in the basement",
    "along the coast",
    "during the meeting",
    "under the old oak",
    "at the edge of town",
    "behind the warehouse",
    "on a Tuesday",
    "without a word",
    "in the data centre",
    "by candlelight",
    "at dawn",
    "in a hurry",
]
ADJECTIVES = [
    "slow",
    "bright",
    "careful",
    "noisy",
    "patient",
    "sudden",
    "gentle",
    "crowded",
    "narrow",
    "efficient",
    "strange",
    "familiar",
    "heavy",
    "quiet",
    "fragile",
    "generous",
    "stubborn",
]
CONNECTIVES = ["because", "although", "while", "so", "but", "and then", "until", "since", "even though"]
NAMES = [
    "Ada",
    "Bruno",
    "Chen",
    "Dara",
    "Elif",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Lena",
    "Mateo",
    "Noor",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tove",
    "Umar",
    "Vera",
    "Wen",
    "Yara",
]
TOPICS = [
    "batching",
    "tokenization",
    "the weather",
    "gardening",
    "bread",
    "trains",
    "music",
    "budgets",
    "caching",
    "sailing",
    "chess",
    "memory bandwidth",
    "birds",
    "latency",
    "maps",
    "tea",
    "bridges",
]
CODE = [
    "def {f}(items):\n    total = 0\n    for item in items:\n        total += item.{a}\n    return total\n",
    "for (int i = 0; i < {n}; ++i) {{\n    sum += values[i] * {m};\n}}\n",
    'if request.{a} > {n}:\n    raise ValueError("{a} too large")\n',
    '{{"id": {n}, "name": "{w}", "tags": ["{t}", "{a}"], "ok": true}}\n',
    "SELECT {a}, COUNT(*) FROM {w}s WHERE {a} > {n} GROUP BY {a};\n",
]


def _sentence(rng: random.Random) -> str:
    shape = rng.randrange(6)
    s, v, o, p = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)
    if shape == 0:
        text = f"{s} {v} {o} {p}"
    elif shape == 1:
        joined = f"{rng.choice(CONNECTIVES)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        text = f"{s} {v} {o} {joined}"
    elif shape == 2:
        text = f"{p}, {s} {v} {o}"
    elif shape == 3:
        first, second = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
        text = f"{s} was {first} and {second}, {rng.choice(CONNECTIVES)} {o} was not"
    elif shape == 4:
        text = f"{rng.choice(NAMES)} {v} {rng.randint(2, 9999)} items {p}"
    else:
        text = f"why had {s} {v} {o}"
        return text[0].upper() + text[1:] + "?"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", ";"]).replace(";", ".")


def _paragraph(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 5:
        return " ".join(_sentence(rng) for _ in range(rng.randint(3, 8)))
    if kind == 5:
        a, b = rng.sample(NAMES, 2)
        lines = [f'{rng.choice([a, b])}: "{_sentence(rng)}"' for _ in range(rng.randint(2, 5))]
        return "\n".join(lines)
    if kind == 6:
        head = f"Notes on {rng.choice(TOPICS)}:"
        return "\n".join([head] + [f"- {_sentence(rng)}" for _ in range(rng.randint(2, 6))])
    if kind == 7:
        rows = [
            f"{rng.choice(NAMES)}, {rng.randint(1, 500)}, {rng.uniform(0, 100):.2f}, {rng.choice(ADJECTIVES)}"
            for _ in range(rng.randint(2, 6))
        ]
        return "name, count, score, mood\n" + "\n".join(rows)
    if kind == 8:
        template = rng.choice(CODE)
        return template.format(
            f=rng.choice(VERBS),
            a=rng.choice(ADJECTIVES),
            n=rng.randint(1, 4096),
            m=rng.randint(2, 64),
            w=rng.choice(NAMES).lower(),
            t=rng.choice(TOPICS),
        )
    q = f"Q: How does {rng.choice(TOPICS)} relate to {rng.choice(TOPICS)}?"
    return q + "\nA: " + " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


def generate(target_bytes: int = 320_000, seed: int = 20261122) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        paragraph = _paragraph(rng)
        parts.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(parts) + "\n"


def main() -> None:
    path = Path(__file__).with_name("data") / "corpus.txt"
    path.write_text(generate(), encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
