"""The demo server's tokenizer: a real byte-level BPE from the `tokenizers` library.

Trained offline at first use on text shipped in the package (data/corpus.txt) and
cached as JSON under ~/.cache/servprof (override with SERVPROF_CACHE_DIR), so every
later start loads it in milliseconds. Like a production tokenizer its cost grows
with the prompt's length. Streaming detokenization goes through
`tokenizers.decoders.DecodeStream`, one token at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

EOS_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
DEFAULT_VOCAB_SIZE = 4096
_TRAIN_LOCK = threading.Lock()


def cache_dir() -> Path:
    override = os.environ.get("SERVPROF_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "servprof"


def _corpus_text() -> str:
    return resources.files("servprof.demo").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def _train(corpus: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    return tokenizer


def load_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """The cached tokenizer, training it once (about a second) when the cache is cold."""
    corpus = _corpus_text()
    digest = hashlib.sha256(f"{vocab_size}\0{corpus}".encode()).hexdigest()[:16]
    path = cache_dir() / f"demo-bpe-{vocab_size}-{digest}.json"
    with _TRAIN_LOCK:
        if path.is_file():
            try:
                return Tokenizer.from_file(str(path))
            except Exception:  # a corrupt cache file is rebuilt, not fatal
                pass
        tokenizer = _train(corpus, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tokenizer.save(str(tmp))
        os.replace(tmp, path)
        return tokenizer


class DemoTokenizer:
    """Encode/decode for the demo server, with the slow-tokenizer fault knob.

    ``slow_us_per_token`` adds that much pure-Python CPU work per produced token,
    holding the GIL, the way slow Python tokenizers (pre/post-processing in
    Python) do.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        slow_us_per_token: float = 0.0,
        *,
        eos_ids: set[int] | None = None,
        add_special_tokens: bool = False,
    ):
        self.tokenizer = tokenizer or load_tokenizer()
        self.slow_us_per_token = float(slow_us_per_token)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        default_eos = self.tokenizer.token_to_id(EOS_TOKEN)
        self.eos_ids = (
            eos_ids if eos_ids is not None else ({default_eos} if default_eos is not None else set())
        )
        # A loaded model's tokenizer.json knows its own special tokens (e.g. BOS): let it add them.
        self.add_special_tokens = add_special_tokens

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while the Rust side works; encode does not.
        ids = self.tokenizer.encode_batch([text], add_special_tokens=self.add_special_tokens)[0].ids
        if self.slow_us_per_token > 0:
            _burn_python_cpu(len(ids) * self.slow_us_per_token * 1000.0)
        return ids

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_stream(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns one token at a time into text, holding back partial UTF-8 sequences."""

    def __init__(self, owner: DemoTokenizer):
        self._tokenizer = owner.tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


def _burn_python_cpu(nanoseconds: float) -> None:
    # A Python loop, not a sleep: it holds the GIL as real slow tokenizers do.
    deadline = time.perf_counter_ns() + int(nanoseconds)
    counter = 0
    while time.perf_counter_ns() < deadline:
        counter += 1
