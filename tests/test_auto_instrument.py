"""servprof.auto: model steps and tokenizer phases marked automatically, with the real profiler
and real models and tokenizers (built locally: nothing is downloaded)."""

from __future__ import annotations

import io
import sys
import threading
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.nn.modules import module as torch_module
from torch.profiler import ProfilerActivity, profile

from servprof.auto import AutoInstrumentation, compiled_model_present
from servprof.auto.context import install_thread_inheritance, request_id_here
from servprof.auto.step_kind import sequence_length as _sequence_length
from servprof.observers import RequestRecord
from servprof.request_context import request_id_var, request_record_var
from servprof.trace.phases import parse_phase_event_name


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(request_id, "POST", "/v1/completions", None, "http", None, None, 0, 0)


def auto_phases(tmp_path: Path, work: Any, session_ids: list[str] | None = None,
                auto: AutoInstrumentation | None = None) -> tuple[list[tuple[str, list[str]]], AutoInstrumentation]:
    """Run ``work`` under the real profiler with the automatic phases on (``auto``: the instance a
    server keeps across its sessions); the auto phases of the exported trace in start order, as
    (phase, request ids)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    auto = auto or AutoInstrumentation()
    prof = profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.start()
    auto.start(lambda: list(session_ids or []), None)
    try:
        work()
    finally:
        auto.stop()
        prof.stop()
        auto.remove()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = sorted((e for e in orjson.loads(path.read_bytes())["traceEvents"] if e.get("ph") == "X"),
                    key=lambda e: e["ts"])
    out = []
    for event in events:
        parsed = parse_phase_event_name(event["name"])
        if parsed and parsed[0].startswith("auto."):
            out.append((parsed[0][len("auto."):], parsed[1]))
    return out, auto


def test_sequence_length_reads_ids_embeddings_and_scalars() -> None:
    assert _sequence_length((torch.ones(1, 7, dtype=torch.long),), None) == 7
    assert _sequence_length((), {"input_ids": torch.ones(4, 1, dtype=torch.long)}) == 1
    assert _sequence_length((), {"inputs_embeds": torch.ones(2, 5, 8)}) == 5
    assert _sequence_length((torch.tensor(3),), None) == 1
    assert _sequence_length((torch.ones(9, dtype=torch.long),), None) == 9
    assert _sequence_length((torch.ones(4, 16),), None) is None  # [B, D] floats: no sequence to read
    assert _sequence_length(("text",), {}) is None
    # An encoder-decoder's decoder step: its decoder tokens, not the encoder's mask beside them.
    assert _sequence_length((), {"attention_mask": torch.ones(1, 9, dtype=torch.long),
                                 "decoder_input_ids": torch.ones(1, 1, dtype=torch.long)}) == 1


def test_hand_written_loop_with_and_without_a_cache(tmp_path: Path) -> None:
    model = TinyLM().eval()
    token = request_id_var.set("req-loop")

    def work() -> None:
        with torch.no_grad():
            ids = torch.ones(1, 6, dtype=torch.long)
            model(ids)  # prefill
            for _ in range(5):  # cached decode: one new token a step
                model(torch.ones(1, 1, dtype=torch.long))
            for length in range(6, 10):  # no cache: the whole sequence again, one longer each step
                model(torch.ones(1, length, dtype=torch.long))
            model.head(torch.ones(1, 16))  # a lone leaf module called from the loop: not a step

    try:
        phases, auto = auto_phases(tmp_path, work)
    finally:
        request_id_var.reset(token)
    steps = [p for p, _ in phases if p in ("prefill", "decode_step")]
    # prefill, 5 cached decodes, then the first no-cache call (length 6 after 1: a new prompt) and 3 growth steps.
    assert steps == ["prefill"] + ["decode_step"] * 5 + ["prefill"] + ["decode_step"] * 3
    assert all(ids == ["req-loop"] for p, ids in phases if p in ("prefill", "decode_step"))
    assert auto.summary()["models"] == ["TinyLM"]


def test_a_step_the_server_marked_itself_is_counted_but_not_recorded_again(tmp_path: Path) -> None:
    """Inside the server's own ``decode_step`` phase an automatic decode step would only add a range
    the analysis drops (explicit markers win); it is still counted for the event budget. A step of
    another kind than the marked one is recorded."""
    import servprof

    model = TinyLM().eval()

    def work() -> None:
        with torch.no_grad():
            model(torch.ones(2, 6, dtype=torch.long))  # unmarked prefill: recorded
            for _ in range(3):
                with servprof.phase("decode_step", request_ids=["a", "b"]):
                    model(torch.ones(2, 1, dtype=torch.long))  # marked by the server: counted only
            with servprof.phase("decode_step", request_ids=["a", "b"]):
                model(torch.ones(2, 6, dtype=torch.long))  # a prefill inside a marked decode step: recorded
            model(torch.ones(2, 1, dtype=torch.long))  # unmarked decode: recorded

    phases, auto = auto_phases(tmp_path, work, session_ids=["a", "b"])
    assert [p for p, _ in phases] == ["prefill", "prefill", "decode_step"]
    assert (auto.steps.steps, auto.steps.prefill_steps, auto.steps.decode_steps) == (6, 2, 4)


def test_transformers_generate_steps_and_tokenizer_phases(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=3)).eval()
    token = request_id_var.set("req-hf")

    def work() -> None:
        inputs = tokenizer(["the quick fox", "a lazy dog jumps"], return_tensors="pt", padding=True)  # batched
        tokenizer.apply_chat_template([{"role": "user", "content": "the fox"}], tokenize=True)
        tokenizer.encode("the dog")
        output = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=3)
        tokenizer.batch_decode(output)
        tokenizer.decode(output[0])

    try:
        phases, _auto = auto_phases(tmp_path, work)
    finally:
        request_id_var.reset(token)
    counts = Counter(p for p, _ in phases)
    # generate(): one batched prefill, then a decode step per further token.
    assert counts["prefill"] == 1 and counts["decode_step"] == 4, counts
    # Outermost calls only: __call__, apply_chat_template, encode; batch_decode, decode.
    assert counts["tokenize"] == 3 and counts["detokenize"] == 2, counts
    assert all(ids == ["req-hf"] for _p, ids in phases)


def test_tiktoken_and_sentencepiece_calls_are_phases(tmp_path: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    sentencepiece = pytest.importorskip("sentencepiece")
    encoding = tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                                 special_tokens={})
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 200),
                                             model_writer=model, vocab_size=30, model_type="bpe")
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    token = request_id_var.set("req-tok")

    def work() -> None:
        encoding.decode(encoding.encode("hello there"))
        processor.decode(processor.encode("the lazy fox"))

    try:
        phases, auto = auto_phases(tmp_path, work)
    finally:
        request_id_var.reset(token)
    assert [p for p, _ in phases] == ["tokenize", "detokenize", "tokenize", "detokenize"]
    assert {"tiktoken", "sentencepiece"} <= set(auto.summary()["tokenizer_libraries"])


def test_one_texts_tokenizer_calls_are_timed_by_their_threads_cpu_and_batches_are_not(tmp_path: Path) -> None:
    """The CPU time of the calling thread tells a working tokenizer from a waiting one only where
    the work runs on that thread: one text. A batch (a list of texts, encode_batch) runs on the
    library's pool threads and is not timed; nor is a call under 1 ms."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                                  trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    long_text = "the quick brown fox jumps over the lazy dog " * 4000  # ~10 ms of work

    def work() -> None:
        tokenizer.encode("the fox")  # well under 1 ms
        tokenizer.encode(long_text)
        tokenizer.encode_batch([long_text] * 4)

    _phases, auto = auto_phases(tmp_path, work)
    (timed,) = auto.summary()["tokenizer_cpu_ns"]
    tid, start_ns, wall_ns, cpu_ns = timed
    assert tid == threading.get_native_id() and start_ns > 0 and wall_ns >= 1_000_000
    assert 0 < cpu_ns <= wall_ns
    assert auto.summary()["tokenizer_calls"]["tokenize"] == 3


def test_nothing_stays_registered_or_patched_after_a_session(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = TinyLM().eval()
    before = (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks),
              Tokenizer.__dict__["encode"])

    def work() -> None:
        for _ in range(6):  # past discovery: the model carries its own hooks
            model(torch.ones(1, 1, dtype=torch.long))

    auto_phases(tmp_path, work)
    after = (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks),
             Tokenizer.__dict__["encode"])
    assert after == before
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_forward_running_when_the_session_starts_does_not_make_its_parts_models(tmp_path: Path) -> None:
    model = TinyLM().eval()
    started, go = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            go.wait(10)
            return x

    model.body.insert(0, Slow())
    thread = threading.Thread(target=lambda: model(torch.ones(1, 3, dtype=torch.long)))
    thread.start()
    started.wait(10)

    def work() -> None:
        go.set()
        thread.join(10)
        model(torch.ones(1, 1, dtype=torch.long))

    phases, auto = auto_phases(tmp_path, work)
    assert auto.summary()["models"] == ["TinyLM"]  # not the Sequential or the Linear it was inside
    assert [p for p, _ in phases] == ["decode_step"]


def _tiny_llama(layers: int, seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


def test_assisted_generation_verifies_drafts_in_decode_steps(tmp_path: Path) -> None:
    """Assisted generation: a draft model proposes tokens, the target verifies several at once over
    its KV cache. Each model's first forward (empty cache) is its prefill; every later one, drafts
    and verifications of several tokens alike, continues the sequence: a decode step."""
    target, draft = _tiny_llama(2, 0), _tiny_llama(1, 1)
    shapes: list[tuple[str, int]] = []
    for name, model in (("target", target), ("draft", draft)):
        model.register_forward_pre_hook(
            lambda _m, _a, kwargs, name=name: shapes.append((name, int(kwargs["input_ids"].shape[-1]))),
            with_kwargs=True)
    ids = torch.arange(3, 15).unsqueeze(0)

    def work() -> None:
        _in_request("req-assisted", lambda: target.generate(input_ids=ids, assistant_model=draft, max_new_tokens=12,
                                                            min_new_tokens=12, do_sample=False))

    phases, _ = auto_phases(tmp_path, work)
    kinds = [p for p, _ids in phases if p in ("prefill", "decode_step")]
    assert len(kinds) == len(shapes)
    assert kinds[:2] == ["prefill", "prefill"] and set(kinds[2:]) == {"decode_step"}
    assert any(length > 1 for _name, length in shapes[2:])  # verifications of several tokens were among them


def test_a_prompt_prefilled_in_chunks_is_prefill_throughout(tmp_path: Path) -> None:
    """``prefill_chunk_size``: generate() prefills a long prompt a chunk at a time over its cache."""
    model = _tiny_llama(1, 0)
    ids = torch.arange(3, 15).unsqueeze(0)

    def work() -> None:
        _in_request("req-chunked", lambda: model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3,
                                                          do_sample=False, prefill_chunk_size=4))

    phases, _ = auto_phases(tmp_path, work)
    # 12 prompt tokens in chunks of 4, then a decode step per further token.
    assert [p for p, _ids in phases if p in ("prefill", "decode_step")] == ["prefill"] * 3 + ["decode_step"] * 2


def test_a_new_turn_over_a_conversations_cache_is_its_prefill(tmp_path: Path) -> None:
    """A chat server that keeps each conversation's cache and passes it back with the next turn:
    that generate()'s first forward goes over a cache that holds the earlier turns, and is a prefill."""
    transformers = pytest.importorskip("transformers")
    model = _tiny_llama(1, 0)
    first = torch.arange(3, 11).unsqueeze(0)

    def work() -> None:
        cache = transformers.DynamicCache()
        out = model.generate(input_ids=first, past_key_values=cache, max_new_tokens=3, min_new_tokens=3,
                             do_sample=False, return_dict_in_generate=True)
        turn = torch.cat([out.sequences, torch.arange(20, 26).unsqueeze(0)], dim=1)  # the user's next message
        _in_request("req-turn", lambda: model.generate(input_ids=turn, past_key_values=out.past_key_values,
                                                       max_new_tokens=3, min_new_tokens=3, do_sample=False))

    phases, _ = auto_phases(tmp_path, work)
    assert [p for p, ids in phases if ids == ["req-turn"]] == ["prefill", "decode_step", "decode_step"]


def test_cached_tokens_are_read_from_shapes_only() -> None:
    transformers = pytest.importorskip("transformers")
    from servprof.auto.step_kind import _cached_tokens

    key = torch.zeros(1, 2, 7, 4)
    assert _cached_tokens({"past_key_values": ((key, key),)}) == 7  # per-layer tuples
    assert _cached_tokens({"past_key_values": ()}) == 0
    assert _cached_tokens({}) is None
    cache = transformers.DynamicCache()
    assert _cached_tokens({"past_key_values": cache}) == 0
    cache.update(key, key, 0)
    assert _cached_tokens({"past_key_values": cache}) == 7
    # A static cache is allocated whole: its shapes say nothing of what it holds.
    static = transformers.StaticCache(config=_tiny_llama(1, 0).config, max_cache_len=32)
    assert _cached_tokens({"past_key_values": static}) is None


def _tiny_t5() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()


def _in_request(request_id: str, work: Any) -> Any:
    token = request_id_var.set(request_id)
    try:
        return work()
    finally:
        request_id_var.reset(token)


def test_a_model_first_run_by_a_request_that_arrives_later_is_found(tmp_path: Path) -> None:
    """A second model (another endpoint's, an encoder-decoder here: its encoder and its decoder steps
    are two outermost modules) first runs after the session's first steps: the sampled request's
    arrival has the hooks look again until a step of a model already found serves it; then the
    global hooks are gone again."""
    from servprof.auto.steps import DISCOVERY_STEPS

    chat, summarizer = TinyLM().eval(), _tiny_t5()
    seen: dict[str, Any] = {}

    def work() -> None:
        with torch.no_grad():
            _in_request("req-chat", lambda: [chat(torch.ones(1, 1, dtype=torch.long)) for _ in range(6)])
        seen["discovering after the first steps"] = auto.steps.discovering
        auto.steps.request_joined("req-summary")
        ids = torch.ones(1, 5, dtype=torch.long)
        _in_request("req-summary", lambda: summarizer.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4,
                                                               do_sample=False))
        seen["discovering after its steps"] = auto.steps.discovering
        seen["global hooks"] = len(torch_module._global_forward_pre_hooks)

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, session_ids=["req-chat", "req-summary"], auto=auto)
    summary_steps = [p for p, ids in phases if ids == ["req-summary"]]
    # The encoder's pass over the prompt, then a decoder step per token (decoder_input_ids: one token each).
    assert summary_steps == ["prefill"] + ["decode_step"] * 4
    assert set(auto.summary()["models"]) == {"TinyLM", "T5ForConditionalGeneration", "T5Stack"}
    assert seen == {"discovering after the first steps": False, "discovering after its steps": False,
                    "global hooks": 0}
    assert auto.steps.discovery_steps > DISCOVERY_STEPS


def test_requests_that_never_run_a_model_keep_the_hooks_looking_for_a_bounded_number_of_steps(
        tmp_path: Path) -> None:
    from servprof.auto.steps import MAX_DISCOVERY_STEPS

    model = TinyLM().eval()
    open_ids = ["req-waiting"]

    def work() -> None:
        auto.steps.request_joined("req-waiting")  # in flight all along, never served by a step
        with torch.no_grad():
            _in_request("req-other", lambda: [model(torch.ones(1, 1, dtype=torch.long)) for _ in range(40)])

    auto = AutoInstrumentation()
    auto_phases(tmp_path, work, session_ids=open_ids, auto=auto)
    assert auto.steps.discovery_steps == MAX_DISCOVERY_STEPS
    assert auto.steps.steps == 40

    # A request that ended without a step waits no more: the next step ends the look.
    def ended() -> None:
        with torch.no_grad():
            _in_request("req-other", lambda: [model(torch.ones(1, 1, dtype=torch.long)) for _ in range(5)])
            auto.steps.request_joined("req-health")  # a request that runs no model, and ends
            _in_request("req-other", lambda: model(torch.ones(1, 1, dtype=torch.long)))

    auto_phases(tmp_path / "ended", ended, session_ids=[], auto=auto)
    assert not auto.steps.discovering
    assert auto.steps.discovery_steps == 5


def test_threads_started_for_a_request_carry_its_id_while_it_runs() -> None:
    install_thread_inheritance()
    record = _record("req-thread")
    seen: dict[str, Any] = {}
    token = request_record_var.set(record)
    try:
        thread = threading.Thread(target=lambda: seen.setdefault("plain", request_id_here()))
        thread.start()
        thread.join()
        from concurrent.futures import ThreadPoolExecutor

        # A pool thread serves many requests: it inherits none, but a job carries the request that
        # submitted it (loop.run_in_executor copies no contextvars), and only while it runs.
        pool = ThreadPoolExecutor(1)
        seen["pool job"] = pool.submit(request_id_here).result()

        def submit_again() -> str | None:  # a job that hands work to another pool
            with ThreadPoolExecutor(1) as inner:
                return inner.submit(request_id_here).result()

        seen["nested job"] = pool.submit(submit_again).result()
    finally:
        request_record_var.reset(token)
    seen["pool job after"] = pool.submit(request_id_here).result()
    pool.shutdown()
    record.end_ns = 1  # the request ended: a thread it started no longer speaks for it
    late = threading.Thread(target=lambda: seen.setdefault("late", request_id_here()))
    token = request_record_var.set(record)
    try:
        late.start()
    finally:
        request_record_var.reset(token)
    late.join()
    assert seen == {"plain": "req-thread", "pool job": "req-thread", "nested job": "req-thread",
                    "pool job after": None, "late": None}


def test_steps_of_an_unknown_thread_carry_the_session_requests(tmp_path: Path) -> None:
    model = TinyLM().eval()

    def work() -> None:
        thread = threading.Thread(target=lambda: model(torch.ones(1, 1, dtype=torch.long)))
        thread.start()  # started outside any request: no id of its own
        thread.join()

    phases, _auto = auto_phases(tmp_path, work, session_ids=["req-a", "req-b"])
    assert phases == [("decode_step", ["req-a", "req-b"])]


@pytest.mark.parametrize("fullgraph", [False, True])  # (a fullgraph compile counts no "frames" in dynamo)
def test_a_compiled_model_gets_no_hooks(tmp_path: Path, fullgraph: bool) -> None:
    model = TinyLM().eval()
    _phases, server_auto = auto_phases(tmp_path / "eager", lambda: model(torch.ones(1, 1, dtype=torch.long)))
    assert server_auto.summary()["decode"] == 1  # an eager session before the compile counted its step
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
    compiled(torch.ones(1, 2, dtype=torch.long))
    assert compiled_model_present()

    def work() -> None:
        compiled(torch.ones(1, 1, dtype=torch.long))

    phases, auto = auto_phases(tmp_path, work, auto=server_auto)
    assert phases == [] and not torch_module._global_forward_pre_hooks
    assert [m["what"] for m in auto.missing()][:1] == ["automatic model steps"]
    assert "torch.compile" in auto.missing()[0]["message"]
    summary = auto.summary()  # this session's counts, not the eager one's
    assert summary["steps"] is None and summary["decode"] == summary["prefill"] == 0 and summary["models"] == []


@pytest.fixture(autouse=True)
def _no_dynamo_counts_leak() -> Iterator[None]:
    """The compiled-model test leaves dynamo's process-wide counters set: reset them so later
    tests (and sessions) in this process still get their hooks."""
    yield
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return
    counters.clear()



def test_no_forward_in_the_process_names_the_engine_that_runs_it_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that saw no forward says the model may run in another process; with vLLM or
    SGLang loaded it says how to profile their engine processes (module stand-ins: only their
    presence in sys.modules is read)."""
    for engine in ("vllm", "sglang"):
        monkeypatch.delitem(sys.modules, engine, raising=False)
    _phases, auto = auto_phases(tmp_path / "plain", lambda: None)
    (entry,) = [m for m in auto.missing() if m["what"] == "automatic model steps"]
    assert "runs in another process" in entry["message"] and "vLLM" not in entry["message"]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    _phases, auto = auto_phases(tmp_path / "engines", lambda: None)
    (entry,) = [m for m in auto.missing() if m["what"] == "automatic model steps"]
    assert "VLLMMiddleware" in entry["message"] and "/start_profile" in entry["message"]


def test_a_torchscript_model_takes_no_hooks_so_the_global_hooks_mark_its_steps(tmp_path: Path) -> None:
    """A ScriptModule refuses Python hooks of its own (RuntimeError). Registering them used to raise
    inside the server's model call. Its steps are marked by the global hooks, kept on for the
    session (a scripted model's nested calls do not go through Python: one call per step), and
    taken away with the rest."""
    from servprof.auto.steps import MAX_DISCOVERY_STEPS

    scripted = torch.jit.script(TinyLM().eval())
    steps = MAX_DISCOVERY_STEPS + 4  # past every discovery window

    def work() -> None:
        with torch.no_grad():
            expected = scripted(torch.ones(1, 3, dtype=torch.long))
            assert torch.equal(_in_request("req-1", lambda: scripted(torch.ones(1, 3, dtype=torch.long))), expected)
            for _ in range(steps):
                _in_request("req-1", lambda: scripted(torch.ones(1, 1, dtype=torch.long)))

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, session_ids=["req-1"], auto=auto)
    assert phases == [("prefill", ["req-1"])] * 2 + [("decode_step", ["req-1"])] * steps
    summary = auto.summary()
    assert summary["models_marked_by_global_hooks"] == ["RecursiveScriptModule"]
    assert summary["problem"] is None
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks

    # The next session knows the model from the start: it is marked from its first call.
    phases, _ = auto_phases(tmp_path / "again", work, session_ids=["req-1"], auto=auto)
    assert len(phases) == steps + 2
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks


class _CacheThatRaises:
    """A server's own cache class whose ``layers`` is a property that fails (not an AttributeError)."""

    @property
    def layers(self) -> Any:
        raise NotImplementedError("layers are allocated lazily")


class _CachedLM(TinyLM):
    def forward(self, ids: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids)


def test_a_hook_that_raises_stops_marking_steps_and_never_fails_the_models_call(tmp_path: Path) -> None:
    model = _CachedLM().eval()
    outputs = []

    def work() -> None:
        with torch.no_grad():
            for _ in range(3):
                _in_request("req-1", lambda: model(torch.ones(1, 1, dtype=torch.long)))
            for _ in range(3):  # reading this cache's tokens raises inside servprof's hook
                outputs.append(_in_request("req-1", lambda: model(torch.ones(1, 4, dtype=torch.long),
                                                                  past_key_values=_CacheThatRaises())))
            _in_request("req-1", lambda: model(torch.ones(1, 1, dtype=torch.long)))

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, session_ids=["req-1"], auto=auto)
    assert [o.shape for o in outputs] == [torch.Size([1, 4, 64])] * 3
    assert phases == [("decode_step", ["req-1"])] * 3  # none after the error
    problem = auto.summary()["problem"]
    assert "NotImplementedError: layers are allocated lazily" in problem and "after 3 step(s)" in problem
    assert [m["what"] for m in auto.missing()][:1] == ["automatic model steps"]
    assert not torch_module._global_forward_pre_hooks and not model._forward_pre_hooks


def _counting_compile(model: torch.nn.Module, compiles: list[int]) -> Any:
    def backend(graph: Any, _example_inputs: Any) -> Any:
        compiles[0] += 1
        return graph.forward

    return torch.compile(model, backend=backend, fullgraph=True)


def test_a_model_first_compiled_during_a_session_is_traced_without_servprofs_hooks(tmp_path: Path) -> None:
    """A server that compiles lazily (its first requests, a new shape) compiles while a session's
    global hooks are on: dynamo traces them with the model. They used to go into the graph and its
    guards (a recompile at every step, their counters guarded) and, with fullgraph=True, failed
    the call. Now they return at once under tracing: every call answers, and the model is compiled
    at most once more than with no session (when the hooks go, dynamo's guard on their number).
    (The real inductor backend is not needed for this: dynamo's tracing and guards are the same.)"""
    shapes = (3, 1, 1, 1, 5, 1, 1)

    def calls(compiled: Any, failures: list[str]) -> None:
        with torch.no_grad():
            for length in shapes:
                try:
                    compiled(torch.ones(1, length, dtype=torch.long))
                except Exception as exc:  # noqa: BLE001 - counted
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])

    torch.manual_seed(0)
    alone, alone_failures = [0], []
    calls(_counting_compile(TinyLM().eval(), alone), alone_failures)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # (a server process compiling for the first time)
    in_session, failures = [0], []
    compiled = _counting_compile(TinyLM().eval(), in_session)
    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, lambda: calls(compiled, failures), session_ids=["r"], auto=auto)
    assert alone_failures == [] and failures == []
    assert alone[0] <= in_session[0] <= alone[0] + 1
    # The compiled module's own hooks run outside its compiled code: its steps are still marked.
    assert len(phases) == len(shapes)
    # Later sessions register no hooks: the process has compiled (a fullgraph compile counts too).
    assert "torch.compile'd model runs in this process" in auto_phases(tmp_path / "next", lambda: None, auto=auto)[1] \
        .summary()["problem"]
    after = in_session[0]
    calls(compiled, failures)  # after the session: nothing compiles again
    assert failures == [] and in_session[0] == after


class _TwoBlockLM(torch.nn.Module):
    """Two blocks with weights between an embedding and a head, as a hand-written model has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
                                          for _ in range(2))
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """A method of its own that runs its parts (the way a generate() method may): one is the step."""
        return self.head(self.blocks[0](self.embed(ids)))


class _Wrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


class _OwnCallLM(_TwoBlockLM):
    """A model whose own ``__call__`` bypasses Module.__call__ (and so every module hook)."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](self.blocks[0](self.embed(ids))))


def test_a_call_of_its_own_that_bypasses_module_call_is_named_too(tmp_path: Path) -> None:
    model = _OwnCallLM().eval()

    def work() -> None:
        with torch.no_grad():
            for _ in range(3):
                model(torch.ones(1, 1, dtype=torch.long))

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, auto=auto)
    assert phases == [] and list(auto.summary()["forward_called_directly"]) == ["_OwnCallLM.__call__"]


def test_a_forward_called_directly_is_named_not_counted_as_its_parts_steps(tmp_path: Path) -> None:
    """``model.forward(x)`` runs no module hook: its two blocks were each taken for a model, two
    "decode steps" per real step and no prefill. Now the session says which forward is called so,
    and where, and marks none of its parts."""
    model = _TwoBlockLM().eval()

    def work() -> None:
        with torch.no_grad():
            model.forward(torch.ones(1, 5, dtype=torch.long))
            for _ in range(6):
                model.forward(torch.ones(1, 1, dtype=torch.long))

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, auto=auto)
    assert phases == []
    direct = auto.summary()["forward_called_directly"]
    assert list(direct) == ["_TwoBlockLM.forward"] and f"{Path(__file__).name}:" in direct["_TwoBlockLM.forward"] \
        and direct["_TwoBlockLM.forward"].endswith("in work")
    (entry,) = [m for m in auto.missing() if m["what"] == "automatic model steps"]
    assert entry["message"].startswith("_TwoBlockLM.forward runs the model without Module.__call__") \
        and "model(x)" in entry["message"]


def test_parts_run_by_another_method_or_a_wrappers_forward_are_still_steps(tmp_path: Path) -> None:
    """Not every outermost part inside a model's code is a piece of a step: one run by the model's
    own generate-like method is one step per call, and a thin wrapper whose forward is called
    directly holds no weights but the model's: the model is the step."""
    model = _TwoBlockLM().eval()
    wrapped = _Wrapper(_TwoBlockLM().eval())

    def work() -> None:
        with torch.no_grad():
            for _ in range(3):
                model.next_logits(torch.ones(1, 1, dtype=torch.long))
            for _ in range(3):
                wrapped.forward(torch.ones(1, 1, dtype=torch.long))

    auto = AutoInstrumentation()
    phases, _ = auto_phases(tmp_path, work, auto=auto)
    assert phases == [("decode_step", [])] * 6
    assert auto.summary()["forward_called_directly"] == {}
    assert set(auto.summary()["models"]) == {"Sequential", "_TwoBlockLM"}
