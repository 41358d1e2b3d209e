"""Traffic datasets for the load harness: what each request asks for.

Formats follow `vllm bench serve`: ShareGPT JSON, custom JSONL `{prompt, output_tokens}`,
timed traces JSONL `{timestamp, input_length, output_length[, hash_ids]}`, plus a bundled
synthetic "representative" mix generated from a seed. Loaders never guess: a malformed
file raises DatasetError naming the file and the line (or entry) that is wrong.

Token counts without a tokenizer are whitespace words; the generated prompts use one
common English word per token, close to one token each for BPE tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

DATASET_NAMES = ("synthetic", "sharegpt", "custom", "trace")

# Common words: each is about one token for GPT-style and SentencePiece tokenizers.
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
)
_WORDS = _WORD_TEXT.split()

# Shared by the requests that carry a common prefix (as a system prompt would be).
COMMON_PREFIX_WORDS = 96


class DatasetError(ValueError):
    """A dataset file or option servprof cannot use; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt, how many tokens to ask for, and when (replay only)."""

    prompt: str
    output_tokens: int
    input_tokens: int
    timestamp_s: float | None = None  # seconds after the trace's first request


def words(count: int, rng: np.random.Generator) -> str:
    picks = rng.integers(0, len(_WORDS), size=max(count, 0))
    return " ".join(_WORDS[i] for i in picks)


def _block_words(block_id: int, block_size: int) -> str:
    # The same hash id always gives the same text, so shared ids give shared prefixes.
    return words(block_size, np.random.default_rng([0x5E12F, block_id]))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    rows: list[tuple[int, dict[str, Any]]] = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    if not rows:
        raise DatasetError(f"{path}: no requests in the file")
    return rows


def load_custom_jsonl(path: str | Path) -> list[RequestSpec]:
    """JSONL, one `{"prompt": str, "output_tokens": int > 0}` per line."""
    path = Path(path)
    specs = []
    for number, row in _read_jsonl(path):
        prompt, output_tokens = row.get("prompt"), row.get("output_tokens")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{path}:{number}: 'prompt' must be a non-empty string")
        if not _positive_int(output_tokens):
            raise DatasetError(f"{path}:{number}: 'output_tokens' must be a positive integer, got {output_tokens!r}")
        specs.append(RequestSpec(prompt, output_tokens, len(prompt.split())))
    return specs


def load_trace_jsonl(path: str | Path, block_size: int = 16, timestamp_unit_s: float = 1e-3) -> list[RequestSpec]:
    """Timed trace JSONL: `{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}`.

    Timestamps are milliseconds (the Mooncake trace convention) and must not go back in
    time. Prompts are generated: one block of `block_size` words per hash id, so
    requests that share hash ids share a prefix, then filler to reach input_length.
    """
    path = Path(path)
    specs = []
    first: float | None = None
    previous = float("-inf")
    for number, row in _read_jsonl(path):
        timestamp = row.get("timestamp")
        input_length, output_length = row.get("input_length"), row.get("output_length")
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
            raise DatasetError(f"{path}:{number}: 'timestamp' must be a number >= 0, got {timestamp!r}")
        if timestamp < previous:
            raise DatasetError(f"{path}:{number}: 'timestamp' {timestamp} is earlier than the line before ({previous})")
        if not _positive_int(input_length):
            raise DatasetError(f"{path}:{number}: 'input_length' must be a positive integer, got {input_length!r}")
        if not _positive_int(output_length):
            raise DatasetError(f"{path}:{number}: 'output_length' must be a positive integer, got {output_length!r}")
        hash_ids = row.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
            raise DatasetError(f"{path}:{number}: 'hash_ids' must be a list of integers")
        previous = timestamp
        first = timestamp if first is None else first
        prefix = " ".join(_block_words(h, block_size) for h in hash_ids).split()[:input_length]
        rng = np.random.default_rng([0x7A11, number])
        prompt = " ".join(prefix + [words(input_length - len(prefix), rng)]).strip()
        specs.append(RequestSpec(prompt, output_length, input_length, (timestamp - first) * timestamp_unit_s))
    return specs


def load_sharegpt(path: str | Path) -> list[RequestSpec]:
    """ShareGPT JSON: a list of `{"conversations": [{"from": .., "value": ..}, ...]}`.

    As vLLM does: the first turn is the prompt and the second turn's length (in words
    here, vLLM uses its tokenizer) is the output length. Conversations with fewer than
    two turns are skipped.
    """
    path = Path(path)
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    specs = []
    for index, entry in enumerate(data):
        where = f"{path}: entry {index}"
        conversations = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conversations, list):
            raise DatasetError(f"{where}: expected an object with a 'conversations' list")
        for turn_number, turn in enumerate(conversations):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise DatasetError(f"{where}: turn {turn_number} needs a string 'value'")
        if len(conversations) < 2:
            continue
        prompt, completion = conversations[0]["value"], conversations[1]["value"]
        output_tokens = len(completion.split())
        if not prompt.strip() or output_tokens < 1:
            continue
        specs.append(RequestSpec(prompt, output_tokens, len(prompt.split())))
    if not specs:
        raise DatasetError(f"{path}: no conversation with a prompt and a reply")
    return specs


def synthetic_mix(
    num_requests: int = 1000,
    seed: int = 0,
    prompt_median: int = 128,
    output_median: int = 48,
    max_prompt: int = 2048,
    max_output: int = 512,
    prefix_share: float = 0.3,
) -> list[RequestSpec]:
    """The bundled "representative" mix, the same for the same arguments.

    Prompt and output lengths are log-normal (long right tail, as in chat traffic), and
    `prefix_share` of the requests start with one common prefix, as a shared system
    prompt does, so prefix caching and tokenization of long shared text both show.
    """
    if num_requests < 1:
        raise DatasetError(f"synthetic mix: num_requests must be >= 1, got {num_requests}")
    if not 0.0 <= prefix_share <= 1.0:
        raise DatasetError(f"synthetic mix: prefix_share must be between 0 and 1, got {prefix_share}")
    rng = np.random.default_rng(seed)
    prompt_lengths = np.clip(rng.lognormal(np.log(prompt_median), 0.9, num_requests), 4, max_prompt).astype(int)
    output_lengths = np.clip(rng.lognormal(np.log(output_median), 0.8, num_requests), 1, max_output).astype(int)
    with_prefix = rng.random(num_requests) < prefix_share
    prefix = words(COMMON_PREFIX_WORDS, np.random.default_rng([seed, 0xC0FFEE]))
    specs = []
    for length, output, shared in zip(prompt_lengths, output_lengths, with_prefix, strict=True):
        body = words(int(length), rng)
        prompt = f"{prefix} {body}" if shared else body
        specs.append(RequestSpec(prompt, int(output), int(length) + (COMMON_PREFIX_WORDS if shared else 0)))
    return specs


def load_dataset(
    name: str,
    path: str | Path | None = None,
    *,
    seed: int = 0,
    num_requests: int = 1000,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
) -> list[RequestSpec]:
    """One dataset by name (see DATASET_NAMES).

    `max_output_tokens` caps what every request asks for; `max_input_tokens` cuts every
    prompt to that many words (its end is dropped), for models with a short context.
    """
    if name not in DATASET_NAMES:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    if name == "synthetic":
        specs = synthetic_mix(num_requests=num_requests, seed=seed)
    else:
        if not path:
            raise DatasetError(f"dataset {name!r} needs a file: pass --dataset-path")
        loader = {"sharegpt": load_sharegpt, "custom": load_custom_jsonl, "trace": load_trace_jsonl}[name]
        specs = loader(path)
    if max_output_tokens is not None:
        if max_output_tokens < 1:
            raise DatasetError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
        specs = [_cap(spec, max_output_tokens) for spec in specs]
    if max_input_tokens is not None:
        if max_input_tokens < 1:
            raise DatasetError(f"max_input_tokens must be >= 1, got {max_input_tokens}")
        specs = [_cut(spec, max_input_tokens) for spec in specs]
    return specs


def _cap(spec: RequestSpec, limit: int) -> RequestSpec:
    if spec.output_tokens <= limit:
        return spec
    return RequestSpec(spec.prompt, limit, spec.input_tokens, spec.timestamp_s)


def _cut(spec: RequestSpec, limit: int) -> RequestSpec:
    prompt_words = spec.prompt.split()
    if len(prompt_words) <= limit:
        return spec
    return RequestSpec(" ".join(prompt_words[:limit]), spec.output_tokens, limit, spec.timestamp_s)


def replay_offsets(specs: Sequence[RequestSpec]) -> np.ndarray:
    """Arrival offsets (s) of a timed trace; DatasetError if the dataset has no timestamps."""
    if not specs or any(spec.timestamp_s is None for spec in specs):
        raise DatasetError("--arrival replay needs a timed trace: use --dataset trace --dataset-path FILE")
    return np.array([spec.timestamp_s for spec in specs], dtype=np.float64)
