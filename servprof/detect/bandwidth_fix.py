"""The remedy a bandwidth finding suggests, written from what was measured: which kind of op
leaves the bandwidth on the table, how many bytes it moves per call, at what share of peak."""

from __future__ import annotations

from typing import Any

from servprof.detect.devices import DeviceSpec

_REMEDIES = {
    "gemm": ("batch more requests into each decode step (every weight read then serves more tokens), or "
             "quantise the weights (8-bit halves the bytes each step reads, 4-bit quarters them)"),
    "attention_matmul": ("matmuls between two [batch, heads, ...] activations are how attention written out by "
                         "hand runs (q @ k.transpose(-2, -1), softmax, then @ v): each writes its whole result to "
                         "memory for the next op to read back; use torch.nn.functional.scaled_dot_product_attention, "
                         "whose fused kernels keep the scores on chip"),
    "attention": ("use a fused decode-attention kernel (FlashAttention / FlashInfer, or the server's paged "
                  "attention) and consider an fp8 KV cache, which halves the bytes read per token"),
    "copy": ("keep tensors in one dtype and layout across the step (cast weights once at load time, not per "
             "step; avoid .contiguous() / .to() inside the loop): every copy reads and writes the whole tensor"),
    "reduction": ("fuse the norm / softmax / reduction with its neighbours (torch.compile, or the fused RMSNorm "
                  "kernels of your server): each one re-reads its input from memory"),
    "elementwise": ("fuse the chain of element-wise ops (torch.compile, or fused add+norm and SiLU-and-mul "
                    "kernels): each one reads and writes its whole tensor"),
    "embedding": ("look up embeddings once per step and keep the indices on the device; each lookup re-reads "
                  "its rows"),
    "index": ("each call copies every element it selects: select once per step and reuse the result, or take a "
              "view (slicing, narrow, select) where the elements are contiguous"),
    "reorder": ("each call copies the whole tensor to put its rows in a new order, as beam search reorders every "
                "layer's KV cache each step (transformers' Cache.reorder_cache): let the beams share one cache by "
                "index instead of copying it (a paged KV cache with a block table, as vLLM and SGLang run beam "
                "search), or search with fewer beams"),
    "grow": ("each torch.cat copies the whole tensor it extends, so a tensor grown by cat every step is copied "
             "whole every step, as transformers' DynamicCache grows every layer's keys and values: preallocate it to "
             "the longest length and write each step's slice in place (generate(..., cache_implementation=\"static\") "
             "in transformers; index_copy_ or slice assignment by hand)"),
    "repeat": ("each call writes its input out `repeats` times: where it repeats a KV cache's heads for grouped-query "
               "attention, hand attention the grouped heads as they are (scaled_dot_product_attention(..., "
               "enable_gqa=True) from torch 2.5, or a kernel that shares each KV head across its query heads) instead "
               "of copying the cache every step"),
    "join": ("each torch.cat / torch.stack copies every tensor it joins: have the producers write into slices of "
             "one preallocated tensor, or let torch.compile fuse the join into them"),
}
# On a CPU the GPU kernels named above do not exist: what applies there instead.
_CPU_REMEDIES = {
    "attention": ("keep the KV cache in bfloat16 (half the bytes of float32 read per token) and preallocated (a "
                  "static cache: a torch.cat per step copies the whole cache every step), and hand it to the fused "
                  "op as it is (a .contiguous() or a transpose per step copies it again)"),
    "embedding": ("look up embeddings once per step; each lookup re-reads its rows"),
}
NEXT_SHARE = 0.5  # a second kind of op leaving at least this share of the first's time gets its remedy too
_FAMILY_WORDS = {"gemm": "GEMMs", "attention_matmul": "hand-written attention matmuls", "attention": "attention ops", "copy": "copies", "reduction": "norms and "
                 "reductions", "elementwise": "element-wise ops", "embedding": "embedding lookups",
                 "index": "index selections", "reorder": "row reorders", "repeat": "repeats", "grow": "concatenations growing a tensor",
                 "join": "concatenations"}


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _worst(groups: list[dict[str, Any]], family: str) -> dict[str, Any]:
    """The group of ``family`` leaving the most time on the table."""
    return max((g for g in groups if (g.get("family") or "elementwise") == family),
               key=lambda g: g.get("left_on_table_us") or g["time_us"])


def _next_kind(groups: list[dict[str, Any]], weight: dict[str, float], first: str, remedies: dict[str, str]) -> str:
    """The remedy of the kind of op leaving the second most time, when that is at least NEXT_SHARE of
    the first's and its worst op is bounded by bandwidth, not overhead (a beam search's cache
    reorders beside the cat that grows the cache: two remedies, both needed)."""
    ranked = sorted((f for f in weight if f != first), key=lambda f: -weight[f])
    if not ranked or weight[ranked[0]] < NEXT_SHARE * weight[first]:
        return ""
    family = ranked[0]
    top = _worst(groups, family)
    if top.get("overhead_bound"):
        return ""
    return (f" Next, the {_FAMILY_WORDS[family]} ({weight[family] / 1e3:.1f} ms left on the table; the worst, "
            f"{top['op']} {top['shapes']}): {remedies.get(family) or _REMEDIES[family]}.")


def fix_text(groups: list[dict[str, Any]], spec: DeviceSpec, share: float, capped: str | None = None,
             in_cache: bool = False, decode: bool = True) -> str:
    """One or two sentences: the op kind that leaves the most time on the table, its figures, what to do.
    ``in_cache``: a step's bytes fit in the device's last-level cache (``capped`` says so). ``decode``:
    the ops are decode steps' (the second kind's remedy is given only for them: the remedies are
    written for decoding, and a whole trace of other work, a vision model's, is not)."""
    if not groups:
        return ""
    weight: dict[str, float] = {}
    for g in groups:
        family = g.get("family") or "elementwise"
        weight[family] = weight.get(family, 0.0) + (g.get("left_on_table_us") or g["time_us"])
    family = max(weight, key=lambda f: weight[f])
    top = _worst(groups, family)
    per_call_bytes = top["bytes"] / max(top["calls"], 1)
    per_call_us = top["time_us"] / max(top["calls"], 1)
    roof_us = (top.get("roofline_us") or 0.0) / max(top["calls"], 1)
    text = (f"The {_FAMILY_WORDS[family]} run at {100 * share:.0f}% of {spec.name}'s peak bandwidth; the worst, "
            f"{top['op']} {top['shapes']}, moves {_size(per_call_bytes)} per call in {per_call_us:.1f} us")
    if roof_us > 0:
        text += f" (the roofline allows {roof_us:.2f} us)"
    if top.get("overhead_bound") or (capped and spec.identified):
        # Not a bandwidth problem: quantising or faster memory would not help these ops.
        why = ("A step's data fits in the last-level cache, so memory bandwidth is not their limit" if in_cache
               else "They move too little for memory bandwidth to be their limit")
        text += (f". {why}: per-op overhead and compute dominate, so fewer, larger ops help (fuse them with "
                 "torch.compile, batch more requests per step, capture the decode step in a CUDA graph on GPU).")
    else:
        remedies = _CPU_REMEDIES if spec.kind == "cpu" else {}
        text += f": {remedies.get(family) or _REMEDIES[family]}."
        text += _next_kind(groups, weight, family, remedies) if decode else ""
    if not spec.identified:
        text += (f" The peak is {spec.basis}, not measured here: run `servprof calibrate` on this machine "
                 "(or pass --device) before acting on the percentage.")
    return text
