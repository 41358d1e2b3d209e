"""Indexing, joining and repeating ops in the bandwidth model: what they move, which kind of remedy
each is, and the element type of a torch.cat, which the profiler does not record for a list of
tensors.

Hand-computed bytes first (written out from each op's semantics, not from the code under test),
then the real profiler on hand-written ops and on transformers' own generate(): beam search
reorders every layer's KV cache with index_select each step, and the default DynamicCache grows
it with torch.cat. Before, the reorder was a "gather" told to "look up embeddings once per
step", and the cat was left out of the bytes (a third of a beam search's decode op time here).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from servprof.detect.analysis import analyse
from servprof.detect.bandwidth_fix import fix_text
from servprof.detect.byte_models import op_cost, op_family
from servprof.detect.devices import resolve_device
from servprof.detect.list_ops import list_cost, list_output_dims, mark_growing
from servprof.phases import phase
from servprof.trace import load_trace

F32, BF16, I64 = "float", "c10::BFloat16", "long int"


def test_gather_and_take_along_dim_move_one_element_per_index():
    # gather(x [64, 1000] f32, 1, idx [64, 5] i64): 320 elements read and written, plus the indices.
    assert op_cost("aten::gather", [[64, 1000], [], [64, 5], []], [F32, "Scalar", I64, "Scalar"],
                   ["", "1", "", "False"]) == (0.0, 2 * 320 * 4 + 320 * 8)
    # take_along_dim(x [1, 8, 792] i64, idx [1, 16, 1] i64, dim=1): the result is [1, 16, 792].
    assert op_cost("aten::take_along_dim", [[1, 8, 792], [1, 16, 1], []], [I64, I64, "Scalar"],
                   ["", "", "1"]) == (0.0, 2 * 16 * 792 * 8 + 16 * 8)
    # no dim: x flattened, one element per index
    assert op_cost("aten::take_along_dim", [[10, 10], [7], []], [F32, I64, ""], ["", "", ""]) \
        == (0.0, 2 * 7 * 4 + 7 * 8)


def test_a_reorder_is_told_from_other_indexing():
    cache = [[8, 4, 789, 32], [], [8]]  # every row of a beam-sized batch, along dim 0
    assert op_family("aten::index_select", cache, ["", "0", ""]) == "reorder"
    assert op_family("aten::index_select", cache, ["", "2", ""]) == "index"  # 8 positions of 789
    assert op_family("aten::index_select", [[8, 4, 789, 32], [], [3]], ["", "0", ""]) == "index"  # some rows
    assert op_family("aten::index_select", [[8], [], [8]], ["", "0", ""]) == "index"  # a vector, not rows
    # every row of a [tokens, hidden] matrix (a server's rows for the logits, all tokens decoding): no cache
    assert op_family("aten::index_select", [[32, 4096], [], [32]], ["", "0", ""]) == "index"
    assert op_family("aten::embedding", [[32000, 512], [4, 7]]) == "embedding"


def test_cat_and_stack_results_and_bytes():
    grown = [[[8, 4, 788, 32], [8, 4, 1, 32]], []]
    assert list_output_dims("aten::cat", grown, ["", "-2"]) == [8, 4, 789, 32]
    assert list_output_dims("aten::cat", [[[0], [3, 5], [2, 5]], []], ["", "0"]) == [5, 5]  # legacy empty part
    assert list_output_dims("aten::stack", [[[3, 5], [3, 5]], []], ["", "1"]) == [3, 2, 5]
    assert list_output_dims("aten::cat", [[[3, 5], [4, 6]], []], ["", "0"]) is None  # not joinable
    assert list_output_dims("aten::stack", [[[3, 5], [3, 6]], []], ["", "0"]) is None
    assert list_cost([8, 4, 789, 32], BF16) == (0.0, 2 * 8 * 4 * 789 * 32 * 2)
    assert list_cost([8, 4, 789, 32], "TensorList") is None and list_cost([8, 0, 32], BF16) is None
    assert op_family("aten::cat", grown) == op_family("aten::stack", [[[3, 5], [3, 5]], []]) == "join"


def _cat_group(parts: list[list[int]]) -> dict:
    return {"op": "aten::cat", "family": "join", "shapes": [parts, []]}


def test_a_cat_grows_a_tensor_when_its_result_is_grown_again():
    # a KV cache extended by one position a step: each step's result is the next step's big part
    steps = [_cat_group([[1, 4, n, 64], [1, 4, 1, 64]]) for n in (100, 101, 102)]
    cls_token = _cat_group([[1, 1, 768], [1, 196, 768]])  # a ViT's class token before its patches: once
    halves = _cat_group([[16, 16, 559, 32], [16, 16, 559, 32]])  # rotary's rotate_half: a join
    groups = [*steps, cls_token, halves]
    mark_growing(groups[1:], [g["shapes"] for g in groups])  # the first step's cat ran above peak: no group
    assert [g["family"] for g in groups[1:]] == ["grow", "grow", "join", "join"]
    mark_growing(groups, [g["shapes"] for g in groups])
    assert [g["family"] for g in groups] == ["grow", "grow", "grow", "join", "join"]


def test_repeat_interleave_writes_its_input_that_many_times():
    # repeat_interleave(kv [1, 2, 78, 16] f32, 2, dim=1): the KV heads read once, written twice over
    assert op_cost("aten::repeat_interleave", [[1, 2, 78, 16], [], [], []], [F32, "Scalar", "Scalar", ""],
                   ["", "2", "1", ""]) == (0.0, (1 + 2) * 2 * 78 * 16 * 4)
    # a tensor of repeats (one count per element): its result's size is in the tensor's values
    assert op_cost("aten::repeat_interleave", [[6], [6], [], []], [F32, I64, "Scalar", ""], ["", "", "0", ""]) is None
    assert op_family("aten::repeat_interleave") == "repeat"


@pytest.mark.parametrize(("family", "says"), [
    ("reorder", "Cache.reorder_cache"), ("grow", 'cache_implementation="static"'), ("index", "view"),
    ("embedding", "embeddings once per step"), ("join", "preallocated tensor"), ("repeat", "enable_gqa=True"),
    ("attention_matmul", "scaled_dot_product_attention"),
])
def test_each_kind_gets_its_own_remedy(family: str, says: str):
    group = {"op": "aten::x", "family": family, "shapes": [[8, 4, 789, 32]], "calls": 10, "time_us": 900.0,
             "bytes": 80e6, "roofline_us": 40.0, "left_on_table_us": 860.0}
    text = fix_text([group], resolve_device("h100", [], True), 0.2)
    assert says in text
    others = {"reorder": "reorder_cache", "grow": "cache_implementation", "embedding": "embeddings once"}
    assert not [word for kind, word in others.items() if kind != family and word in text]


def test_a_second_kind_leaving_half_as_much_gets_its_remedy_too():
    def group(family: str, left_us: float, overhead: bool = False) -> dict:
        return {"op": f"aten::{family}", "family": family, "shapes": [[6, 4, 1500, 32]], "calls": 10,
                "time_us": left_us + 100.0, "bytes": 80e6, "roofline_us": 100.0, "left_on_table_us": left_us,
                "overhead_bound": overhead}

    h100 = resolve_device("h100", [], True)
    both = fix_text([group("grow", 2000.0), group("reorder", 1200.0)], h100, 0.2)
    assert "cache_implementation" in both and "Next, the row reorders (1.2 ms left on the table" in both
    assert "reorder_cache" in both
    assert "Next" not in fix_text([group("grow", 2000.0), group("reorder", 900.0)], h100, 0.2)  # under half
    # a whole trace of other work (no decode steps): the decode remedies are not stacked up
    assert "Next" not in fix_text([group("grow", 2000.0), group("reorder", 1200.0)], h100, 0.2, decode=False)
    assert "Next" not in fix_text([group("grow", 2000.0), group("reorder", 1200.0, overhead=True)], h100, 0.2)


# --- the real profiler ----------------------------------------------------------------------------

def _kernels(path: Path) -> list[dict]:
    return analyse(load_trace(path), device="cpu").kernels


def test_a_cat_takes_the_type_of_the_op_that_reads_it(tmp_path: Path):
    torch.manual_seed(0)
    cache, q = torch.randn(2, 4, 300, 16, dtype=torch.bfloat16), torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    ids = torch.arange(6)
    path = tmp_path / "cat.json"
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
          phase("decode_step", request_ids=["r1"])):
        grown = torch.cat([cache, q], dim=-2)  # the KV cache, grown by one position
        torch.nn.functional.scaled_dot_product_attention(q, grown, grown)
        torch.cat([ids, ids])  # nothing reads the result: its type is unknown
    prof.export_chrome_trace(str(path))
    cats = [p for p in _kernels(path) if p["op"] == "aten::cat"]
    assert len(cats) == 1, cats
    assert cats[0]["types"][0] == "TensorList[c10::BFloat16]" and cats[0]["family"] == "join"
    assert cats[0]["bytes"] == 2 * 2 * 4 * 301 * 16 * 2  # the parts read, the result written, 2 bytes each
    summary = analyse(load_trace(path), device="cpu").summary["bandwidth"]
    assert "aten::cat" in [o["name"] for o in summary["unmodelled"]["top_ops"]]  # the ids' cat, left out


def test_hand_written_attention_is_told_from_weight_gemms(tmp_path: Path):
    """q @ k.transpose(-2, -1) and the probabilities @ v: matmuls of two 4-D activations (no weight is
    4-D); the projections before them are GEMMs over weights."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 1, 64), torch.randn(64, 64)
    k, v = torch.randn(2, 4, 300, 16), torch.randn(2, 4, 300, 16)
    path = tmp_path / "attention.json"
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
          phase("decode_step", request_ids=["r1"])):
        q = torch.nn.functional.linear(x, w).view(2, 1, 4, 16).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).softmax(-1)
        scores @ v
    prof.export_chrome_trace(str(path))
    families = {(p["op"], p["family"]) for p in _kernels(path) if p["op"] in ("aten::matmul", "aten::linear")}
    assert families == {("aten::matmul", "attention_matmul"), ("aten::linear", "gemm")}
    assert op_family("aten::bmm", [[16, 5185, 64], [16, 64, 5185]]) == "gemm"  # 3-D: an MoE's expert weights are too


def test_a_repeat_is_counted_once_not_also_its_index_select(tmp_path: Path):
    """repeat_interleave(int) runs an index_select inside it: the repeat is the op counted."""
    kv = torch.randn(1, 2, 78, 16)
    path = tmp_path / "repeat.json"
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
          phase("decode_step", request_ids=["r1"])):
        kv.repeat_interleave(2, dim=1)
    prof.export_chrome_trace(str(path))
    ops = {p["op"]: p for p in _kernels(path)}
    assert set(ops) == {"aten::repeat_interleave"}
    assert ops["aten::repeat_interleave"]["bytes"] == (1 + 2) * kv.numel() * 4
    assert ops["aten::repeat_interleave"]["family"] == "repeat"


transformers = pytest.importorskip("transformers")
BEAMS = 4


@pytest.fixture(scope="module")
def beam_search(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own beam search over a tiny Llama (random weights, no download)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.arange(3, 43).unsqueeze(0)
    path = tmp_path_factory.mktemp("beams") / "beam_search.json"
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 record_shapes=True) as prof:
        model.generate(prompt, max_new_tokens=5, min_new_tokens=5, num_beams=BEAMS, do_sample=False)
    prof.export_chrome_trace(str(path))
    return path


def test_beam_search_cache_reorders_and_growth_are_modelled(beam_search: Path):
    points = _kernels(beam_search)
    reorders = [p for p in points if p["family"] == "reorder"]
    # every layer's keys and values, [beams, heads, positions, head dim], reordered by beam
    assert reorders and all(p["op"] == "aten::index_select" and len(p["shapes"][0]) == 4
                            and p["shapes"][0][0] == BEAMS and p["shapes"][0][1:2] == [4] for p in reorders)
    for p in reorders:
        index_bytes = {"int": 4, "long int": 8}[p["types"][2]]  # (transformers' beam indices are int32 now)
        assert p["bytes"] == 2 * math.prod(p["shapes"][0]) * 4 + BEAMS * index_bytes  # the float cache, the indices
    cats = [p for p in points if p["op"] == "aten::cat" and len(p["shapes"][0][0]) == 4]  # the cache's
    assert cats and all(p["types"][0] == "TensorList[float]" for p in cats)
    # Each step's cache cat grows the one before it's result (its groups are "grow"); rotate_half's
    # cat of two equal halves stays a join.
    groups = {str(p["shapes"]): {"op": p["op"], "family": p["family"], "shapes": p["shapes"]} for p in cats}
    mark_growing(list(groups.values()), [p["shapes"] for p in points if p["op"] == "aten::cat"])
    growing = [g for g in groups.values() if g["shapes"][0][0][2] != g["shapes"][0][1][2]]
    assert growing and all(g["family"] == "grow" for g in growing), growing
    assert all(g["family"] == "join" for g in groups.values() if g not in growing)
    for p in cats:
        parts = p["shapes"][0]
        assert p["bytes"] == 2 * sum(math.prod(part) for part in parts) * 4
    finding = next(f for f in analyse(load_trace(beam_search), device="cpu").findings
                   if f.kind == "bandwidth_bound_decode")
    # The cache's cats (the cache so far and this step's position, [beams, heads, positions, head
    # dim]): grown step after step, whichever of them made the top ten. Other cats may make it too,
    # on a busy machine (their time stretched by descheduling), and are joins: rotate_half's cat of
    # two equal halves, [4, 4, 1, 4] each.
    cache_cats = [g for g in finding.evidence["top_ops"] if g["op"] == "aten::cat" and len(g["shapes"][0]) == 2
                  and len(g["shapes"][0][0]) == 4 and g["shapes"][0][0][2] != g["shapes"][0][1][2]]
    assert {g["family"] for g in cache_cats} <= {"grow"}, cache_cats
    assert {g["family"] for g in finding.evidence["top_ops"] if g["op"] == "aten::cat"} <= {"grow", "join"}
    assert not [p for p in points if p["family"] == "embedding" and p["op"] != "aten::embedding"]
