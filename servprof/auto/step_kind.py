"""What kind of step an outermost forward is, read from its inputs (serving threads, per step).

Prefill or decode is read from the input's shape: ``decoder_input_ids`` (an encoder-decoder's
decoder step), ``input_ids`` / ``inputs_embeds`` keyword (transformers' ``generate`` passes them
so) or the first tensor argument; an encoder's pass over its input reads as prefill.
Sequence length 1 is a decode step (KV-cached decode, ``[B, 1]`` batches). So is a step of
several tokens over a KV cache that already holds tokens, read from a dynamic cache's shapes
(a draft's tokens verified: assisted generation, prompt lookup), unless ``generate()`` makes it
as its prefill (a prompt prefilled in chunks, a new turn over a conversation's cache). With no cache to read, a 2-D attention mask longer than the input, or a
length one more than the previous step's on the same thread (a loop without a KV cache), is a
decode step. Any other length > 1 is a prefill. A 1-D batch of decode tokens (``[B]``, no
sequence dimension) cannot be told from a prompt and reads as prefill.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_SEQUENCE_KEYWORDS = ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds")
_Tensor = torch.Tensor


def sequence_length(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int | None:
    tensor = None
    if kwargs:
        for keyword in _SEQUENCE_KEYWORDS:
            tensor = kwargs.get(keyword)
            if tensor is not None:
                break
    if tensor is None:
        for value in args[:4]:
            if isinstance(value, _Tensor):
                tensor = value
                break
        else:
            if kwargs:
                tensor = next((v for v in kwargs.values() if isinstance(v, _Tensor)), None)
    if not isinstance(tensor, _Tensor):
        return None
    shape = tensor.shape
    if tensor.is_floating_point():
        # [B, T, D] embeddings; a 1-D/2-D float input has no sequence dimension to read.
        return int(shape[1]) if len(shape) >= 3 else None
    if len(shape) == 0:
        return 1
    return int(shape[-1]) if len(shape) <= 2 else int(shape[1])


def extends_sequence(seq: int, last_seq: int, kwargs: dict[str, Any] | None) -> bool:
    """A step of several tokens that continues a sequence: over a KV cache that holds tokens (a
    draft's tokens verified, as in assisted generation or prompt lookup), or, with no cache to
    read, under a 2-D attention mask longer than the input (``generate()`` passes the whole
    sequence's when it pads) or one token longer than the thread's previous step (a loop
    without a KV cache). A cache that holds none is a prefill's."""
    cached = _cached_tokens(kwargs) if kwargs else None
    if cached is not None:
        return cached > 0 and not _in_prefill_call()
    mask = kwargs.get("attention_mask") if kwargs else None
    if isinstance(mask, _Tensor) and mask.dim() == 2 and int(mask.shape[-1]) > seq:
        return True
    return last_seq > 0 and seq == last_seq + 1


def _in_prefill_call() -> bool:
    """Called from transformers' ``generate()`` prefill (its ``_prefill``: a ``generate()``'s first
    forward), other than an assistant model's in assisted generation (its ``generate()`` runs again
    for every draft, from the tokens accepted since: a step of the request's decoding). Such a
    prefill can go over a cache that holds tokens: a prompt prefilled in chunks
    (``prefill_chunk_size``), a new turn over a conversation's cache passed back in."""
    frame = sys._getframe(2)
    prefill = False
    for _ in range(32):
        if frame is None:
            break
        code = frame.f_code
        if "transformers" in code.co_filename:
            if code.co_name == "_prefill":
                prefill = True
            elif code.co_name == "get_candidates":
                return False
        frame = frame.f_back
    return prefill


def _cached_tokens(kwargs: dict[str, Any]) -> int | None:
    """Tokens the step's ``past_key_values`` holds, where its shapes say so (None: no cache, or one
    that cannot be read without waiting for the device, as a static cache allocated whole)."""
    past = kwargs.get("past_key_values")
    if past is None:
        return None
    if isinstance(past, (tuple, list)):  # per-layer (key, value) tuples: a hand-written loop, older transformers
        if not past:
            return 0
        key = past[0][0] if isinstance(past[0], (tuple, list)) and past[0] else None
    else:  # transformers' Cache: its first layer's keys, where they grow with the sequence
        layers = getattr(past, "layers", None)
        if isinstance(layers, list) and not layers:
            return 0  # (a dynamic cache before its first step)
        layer = layers[0] if isinstance(layers, list) else None
        if not type(layer).__name__.startswith("Dynamic"):
            return None
        if getattr(layer, "is_initialized", True) is False:
            return 0
        key = getattr(layer, "keys", None)
    return int(key.shape[-2]) if isinstance(key, _Tensor) and key.dim() >= 2 else None


def frame_kwargs() -> dict[str, Any] | None:
    """The keyword arguments of the module call a global pre-hook is running for (global
    pre-hooks get no kwargs): ``_call_impl``'s ``kwargs``, two frames up. Only used for a
    module's first outermost call; its own kwargs hook covers the later ones."""
    try:
        frame = sys._getframe(2)
        for _ in range(3):
            if frame is None:
                return None
            kwargs = frame.f_locals.get("kwargs")
            if isinstance(kwargs, dict):
                return kwargs
            frame = frame.f_back
    except (ValueError, AttributeError):
        pass
    return None


_CALL_CODES = frozenset(c for c in (getattr(torch.nn.Module._call_impl, "__code__", None),
                                    getattr(torch.nn.Module._wrapped_call_impl, "__code__", None)) if c is not None)


def inside_module_call(depth_to_skip: int) -> bool:
    """A module call is already running on this thread below the current one: one that began
    before the hooks were registered (a forward in flight when the session started)."""
    frame = sys._getframe(depth_to_skip)
    seen = 0
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            seen += 1
            if seen > 2:  # the current call's own _wrapped_call_impl and _call_impl
                return True
        frame = frame.f_back
    return False


def looks_like_model(module: torch.nn.Module) -> bool:
    return bool(module._modules) and next(module.parameters(), None) is not None


# A model's methods that run a whole step: ``forward`` called directly, or a ``__call__`` of its own
# that bypasses Module.__call__ (neither runs a module hook).
_STEP_METHODS = ("forward", "__call__")


def forward_called_directly(module: torch.nn.Module, depth_to_skip: int) -> tuple[str, str] | None:
    """Whether ``module`` is called, as the outermost call on its thread, from the ``forward`` of a
    model that contains it, that forward having been called directly (``model.forward(x)``, which
    runs no module hook): then it is one of several parts of each step, not a model of its own
    (unless it holds all of that model's parameters: a wrapper's forward around the model).
    Returns (the model's class and method, ``Model.forward``; where it was called: ``file:line in
    function``)."""
    frame = sys._getframe(depth_to_skip)
    for _ in range(12):
        if frame is None:
            return None
        code = frame.f_code
        if code not in _CALL_CODES and code.co_name != "inner":  # (_call_impl's closure for hooks)
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and owner is not module:
                if code.co_name not in _STEP_METHODS or not any(part is module for part in owner.modules()):
                    return None  # another method (a generate() calling its parts, one step each), another model
                if {id(p) for p in owner.parameters()} <= {id(p) for p in module.parameters()}:
                    return None  # the part holds all of the model's weights (a thin wrapper): it is the step
                caller = frame.f_back
                where = f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}" if caller else "?"
                return f"{type(owner).__qualname__}.{code.co_name}", where
        frame = frame.f_back
    return None
