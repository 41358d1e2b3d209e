"""Byte and FLOP models, one op form at a time, against bytes computed by hand in each test.

Every figure below is written out from the op's semantics (what it must read and write, each
tensor at its own element size), not taken from the code under test. The last tests record the
same forms with the real torch.profiler and check that the detector counts each op once, at the
level that does the work (aten::to, not also the _to_copy and copy_ inside it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servprof.detect.analysis import analyse
from servprof.detect.byte_models import op_cost
from servprof.phases import phase
from servprof.trace import load_trace

F32, BF16, I64 = "float", "c10::BFloat16", "long int"


def bytes_of(*args: object) -> float:
    cost = op_cost(*args)  # type: ignore[arg-type]
    assert cost is not None, args
    return cost[1]


# --- reductions: the output is the reduced shape ----------------------------------------------

def test_mean_over_last_dim_writes_the_reduced_shape():
    # The case: RMSNorm's mean over [16, 559, 1024] fp32, keepdim.
    n = 16 * 559 * 1024
    assert bytes_of("aten::mean", [[16, 559, 1024], [], [], []], [F32, "ScalarList", "Scalar", ""],
                    ["", "[-1]", "True", ""]) == n * 4 + 16 * 559 * 4


def test_full_and_partial_reductions():
    # sum over everything (dim list empty) -> one element.
    assert bytes_of("aten::sum", [[4, 8], [], [], []], [F32, "ScalarList", "Scalar", ""], ["", "[]", "False", ""]) \
        == 32 * 4 + 4
    # sum(self, dtype=double): the dtype argument is not a dim; the single output is 8 bytes.
    assert bytes_of("aten::sum", [[4, 8], []], [F32, "Scalar"], ["", "7"]) == 32 * 4 + 8
    # sum over dims 0 and 2 of [2, 3, 5], output in double (dtype code 7).
    assert bytes_of("aten::sum", [[2, 3, 5], [], [], []], [F32, "ScalarList", "Scalar", "Scalar"],
                    ["", "[0, 2]", "False", "7"]) == 30 * 4 + 3 * 8
    assert bytes_of("aten::amax", [[4, 8], [], []], [BF16, "ScalarList", "Scalar"], ["", "[-1]", "True"]) \
        == 32 * 2 + 4 * 2
    # argmax writes int64 indices; max.dim writes values and int64 indices.
    assert bytes_of("aten::argmax", [[4, 8], [], []], [F32, "Scalar", "Scalar"], ["", "-1", "False"]) == 32 * 4 + 4 * 8
    assert bytes_of("aten::max", [[4, 8], [], []], [F32, "Scalar", "Scalar"], ["", "1", "False"]) \
        == 32 * 4 + 4 * (4 + 8)
    assert bytes_of("aten::max", [[4, 8]], [F32], [""]) == 32 * 4 + 4  # max(self): one value
    assert bytes_of("aten::max", [[4, 8], [4, 8]], [F32, F32]) == 3 * 32 * 4  # max(a, b): element-wise
    # var(self, dim=[-1], correction, keepdim): one float per row.
    assert bytes_of("aten::var", [[6, 10], [], [], []], [F32, "ScalarList", "Scalar", "Scalar"],
                    ["", "[-1]", "1", "False"]) == 60 * 4 + 6 * 4
    assert bytes_of("aten::linalg_vector_norm", [[6, 10], [], [], [], []], [F32, "Scalar", "ScalarList", "Scalar", ""],
                    ["", "2", "[-1]", "False", ""]) == 60 * 4 + 6 * 4


def test_softmax_like_ops_write_their_input_shape():
    n = 3 * 2520
    assert bytes_of("aten::softmax", [[3, 2520], [], []], [F32, "Scalar", ""], ["", "-1", ""]) == 2 * n * 4
    # softmax(bf16, dtype=float): reads 2 bytes, writes 4 per element.
    assert bytes_of("aten::softmax", [[3, 2520], [], []], [BF16, "Scalar", "Scalar"], ["", "-1", "6"]) == n * 2 + n * 4
    # _softmax(half_to_float=True)
    assert bytes_of("aten::_softmax", [[3, 2520], [], []], [BF16, "Scalar", "Scalar"], ["", "-1", "True"]) \
        == n * 2 + n * 4


def test_norms_read_input_and_weight_and_write_the_input_shape():
    n = 4 * 512
    assert bytes_of("aten::native_layer_norm", [[4, 512], [], [512], [512], []], [BF16, "ScalarList", BF16, BF16, "Scalar"],
                    ["", "[512]", "", "", "1e-05"]) == n * 2 + 512 * 2 * 2 + n * 2
    assert bytes_of("aten::rms_norm", [[4, 512], [], [512], []], [F32, "ScalarList", F32, ""], ["", "[512]", "", ""]) \
        == n * 4 + 512 * 4 + n * 4


# --- copies: read the source, write the destination, each at its own element size ---------------

def test_dtype_converting_copy():
    n = 16 * 559 * 1024
    # copy_(dst fp32, src bf16): 2 bytes read + 4 written per element (not three tensors).
    assert bytes_of("aten::copy_", [[16, 559, 1024], [16, 559, 1024], []], [F32, BF16, "Scalar"], ["", "", "False"]) \
        == n * 6
    assert bytes_of("aten::copy_", [[1024], [1024], []], [BF16, F32, "Scalar"], ["", "", "False"]) == 1024 * 6
    # A broadcast source (stride 0 along the expanded dim) is read once.
    assert bytes_of("aten::copy_", [[8, 16], [8, 16], []], [F32, F32, "Scalar"], ["", "", "False"],
                    [[16, 1], [0, 1], []]) == 8 * 16 * 4 + 16 * 4


def test_to_and_to_copy_with_a_target_dtype():
    n = 1024
    assert bytes_of("aten::to", [[n], [], [], [], []], [F32, "Scalar", "Scalar", "Scalar", ""],
                    ["", "15", "False", "False", ""]) == n * 4 + n * 2  # fp32 -> bf16
    assert bytes_of("aten::_to_copy", [[n], [], [], [], [], [], []], [BF16, "Scalar", "", "", "", "Scalar", ""],
                    ["", "6", "", "", "", "False", ""]) == n * 2 + n * 4  # bf16 -> fp32
    # to(device, dtype=int32, ...): the dtype is the third argument.
    assert bytes_of("aten::to", [[n], [], [], [], [], []], [I64, "", "Scalar", "Scalar", "Scalar", ""],
                    ["", "", "3", "False", "False", ""]) == n * 8 + n * 4
    # Same dtype: to() usually returns its input; the copy_ inside (if any) is what moves bytes.
    assert op_cost("aten::to", [[n], [], [], [], []], [F32, "Scalar", "Scalar", "Scalar", ""],
                   ["", "6", "False", "False", ""]) is None


# --- element-wise and in place ------------------------------------------------------------------

def test_in_place_ops_write_their_first_argument():
    n = 4096
    assert bytes_of("aten::add_", [[n], [n], []], [F32, F32, "Scalar"], ["", "", "1"]) == 3 * n * 4
    assert bytes_of("aten::mul_", [[n], []], [BF16, "Scalar"], ["", "0.5"]) == 2 * n * 2
    assert bytes_of("aten::fill_", [[n], []], [F32, "Scalar"], ["", "0."]) == n * 4  # write only
    assert bytes_of("aten::zero_", [[n]], [BF16], [""]) == n * 2


def test_broadcasting_reads_each_input_once_and_writes_the_broadcast_shape():
    # [16, 1, 1024] * [16, 559, 1]: the output [16, 559, 1024] is larger than either input.
    assert bytes_of("aten::mul", [[16, 1, 1024], [16, 559, 1]], [BF16, BF16]) \
        == (16 * 1024 + 16 * 559 + 16 * 559 * 1024) * 2
    # An expanded input (stride 0) holds only its distinct elements.
    assert bytes_of("aten::add", [[8, 64], [8, 64], []], [F32, F32, "Scalar"], ["", "", "1"],
                    [[64, 1], [0, 1], []]) == 8 * 64 * 4 + 64 * 4 + 8 * 64 * 4
    # Mixed dtypes promote to the wider float; comparisons write bool.
    assert bytes_of("aten::add", [[100], [100], []], [BF16, F32, "Scalar"]) == 100 * 2 + 100 * 4 + 100 * 4
    assert bytes_of("aten::eq", [[100], [100]], [I64, I64]) == 100 * 8 * 2 + 100
    assert bytes_of("aten::where", [[4, 8], [4, 8], []], ["bool", F32, "Scalar"]) == 32 + 32 * 4 + 32 * 4
    assert op_cost("aten::add", [[3, 4], [5, 4]], [F32, F32]) is None  # not broadcastable


def test_a_python_number_does_not_widen_a_tensor_of_its_category():
    """torch's promotion, as record_shapes writes it: ``x * 0.125`` records the Python float as a
    0-dim "double". It leaves a bf16 tensor's result bf16 (TimeSformer's attention scaling,
    [8, 12, 3137, 3137], was modelled as writing float64: 9.4 GB a call, "faster than an H100's
    peak"); a higher category raises an int tensor's result to the default dtype."""
    n = 8 * 12 * 3137 * 3137
    assert bytes_of("aten::mul", [[8, 12, 3137, 3137], []], [BF16, "double"]) == n * 2 + 8 + n * 2
    assert bytes_of("aten::mul", [[100], []], ["int", "double"]) == 100 * 4 + 8 + 100 * 4  # -> float32
    assert bytes_of("aten::add", [[100], [], []], ["bool", I64, "Scalar"]) == 100 + 8 + 100 * 8  # -> int64
    assert bytes_of("aten::add", [[100], [], []], ["int", I64, "Scalar"]) == 100 * 4 + 8 + 100 * 4  # stays int32
    assert bytes_of("aten::mul", [[], []], ["double", "double"]) == 24  # 0-dim alone: as they are


@pytest.mark.parametrize("make", [
    lambda: torch.ones(64, 32, dtype=torch.bfloat16) * 0.125,
    lambda: torch.ones(64, 32, dtype=torch.int32) * 0.5,
    lambda: torch.ones(64, 32, dtype=torch.bool) + 1,
    lambda: torch.ones(64, 32, dtype=torch.int32) + 3,
    lambda: torch.ones(64, 32, dtype=torch.float16) + torch.ones(64, 32, dtype=torch.float32),
    lambda: torch.ones(64, 32, dtype=torch.bfloat16) * torch.tensor(2.0, dtype=torch.bfloat16),
], ids=["bf16*float", "int*float", "bool+int", "int+int", "f16+f32", "bf16*0dim-bf16"])
def test_the_result_bytes_match_what_torch_wrote(tmp_path: Path, make) -> None:
    """The op recorded by the real profiler, and its model's write: the bytes of the tensor torch
    returned (the model's total less what it reads, each input at its own recorded size)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        result = make()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    trace = load_trace(tmp_path / "t.json")
    (row,) = [r for r in range(len(trace)) if trace.name(r) in ("aten::mul", "aten::add")]
    args = trace.args(row)
    cost = op_cost(trace.name(row), args["Input Dims"], args["Input type"], args.get("Concrete Inputs"))
    assert cost is not None
    sizes = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "int": 4, "long int": 8, "bool": 1}
    reads = sum(max(1, int(torch.tensor(dims).prod())) * sizes[kind]
                for dims, kind in zip(args["Input Dims"], args["Input type"], strict=False) if kind in sizes)
    assert cost[1] - reads == result.numel() * result.element_size()


_X, _OUT = torch.ones(64, 32), torch.empty(64, 32)
_MASK = torch.ones(64, 32, dtype=torch.bool)
F32_TENSOR = 64 * 32 * 4


@pytest.mark.parametrize(("name", "call", "expected"), [
    # out= is the last tensor torch records: written once, never read (the optimiser-style
    # torch.mul(x, s, out=y) of a profiled training step read as three tensors, "over an A100's peak")
    ("aten::mul", lambda: torch.mul(_X, 0.5, out=_OUT), F32_TENSOR + 8 + F32_TENSOR),
    ("aten::add", lambda: torch.add(_X, _X, out=_OUT), 3 * F32_TENSOR),
    ("aten::exp", lambda: torch.exp(_X, out=_OUT), 2 * F32_TENSOR),
    ("aten::where", lambda: torch.where(_MASK, _X, _X, out=_OUT), 64 * 32 + 3 * F32_TENSOR),
    ("aten::addcmul", lambda: torch.addcmul(_X, _X, _X, value=2, out=_OUT), 4 * F32_TENSOR),
    # tensors that are inputs, wherever they sit: clamp's bounds, masked_fill's 0-dim value
    ("aten::clamp", lambda: torch.clamp(_X, min=torch.zeros(64, 32), max=torch.ones(64, 32)), 4 * F32_TENSOR),
    ("aten::masked_fill", lambda: torch.masked_fill(_X, _MASK, torch.tensor(1.0)), F32_TENSOR + 64 * 32 + 4 + F32_TENSOR),
], ids=["mul-out", "add-out", "exp-out", "where-out", "addcmul-out", "clamp-tensors", "masked_fill-tensor"])
def test_an_out_argument_is_written_not_read(tmp_path: Path, name: str, call, expected: int) -> None:
    with torch.profiler.profile(record_shapes=True) as prof:
        call()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    trace = load_trace(tmp_path / "t.json")
    (row,) = [r for r in range(len(trace)) if trace.name(r) == name]
    args = trace.args(row)
    assert bytes_of(name, args["Input Dims"], args["Input type"], args.get("Concrete Inputs")) == expected


# --- GEMMs and attention -------------------------------------------------------------------------

def test_gemm_forms():
    flops, nbytes = op_cost("aten::mm", [[8, 256], [256, 512]], [F32, F32])
    assert flops == 2 * 8 * 256 * 512 and nbytes == (8 * 256 + 256 * 512 + 8 * 512) * 4
    # addmm: the bias [N] is read (once) and added: + M*N FLOPs.
    flops, nbytes = op_cost("aten::addmm", [[512], [8, 256], [256, 512], [], []], [BF16, BF16, BF16, "Scalar", "Scalar"],
                            ["", "", "", "1", "1"])
    assert flops == 2 * 8 * 256 * 512 + 8 * 512
    assert nbytes == (512 + 8 * 256 + 256 * 512 + 8 * 512) * 2
    # linear(x [2, 3, 64], W [128, 64], b [128]): M = 6.
    flops, nbytes = op_cost("aten::linear", [[2, 3, 64], [128, 64], [128]], [F32, F32, F32])
    assert flops == 2 * 6 * 128 * 64 + 6 * 128 and nbytes == (6 * 64 + 128 * 64 + 128 + 6 * 128) * 4
    flops, nbytes = op_cost("aten::bmm", [[4, 8, 16], [4, 16, 32]], [F32, F32])
    assert flops == 2 * 4 * 8 * 16 * 32 and nbytes == 4 * (8 * 16 + 16 * 32 + 8 * 32) * 4
    # matmul with broadcast batch dims: [2, 1, 4, 8] @ [3, 8, 5] -> [2, 3, 4, 5].
    flops, nbytes = op_cost("aten::matmul", [[2, 1, 4, 8], [3, 8, 5]], [F32, F32])
    assert flops == 2 * 6 * 4 * 5 * 8 and nbytes == (2 * 4 * 8 + 3 * 8 * 5 + 6 * 4 * 5) * 4
    flops, nbytes = op_cost("aten::mv", [[64, 32], [32]], [F32, F32])
    assert flops == 2 * 64 * 32 and nbytes == (64 * 32 + 32 + 64) * 4
    # fp8 GEMM writing bf16 (out_dtype code 15): 1-byte inputs, 2-byte output.
    flops, nbytes = op_cost("aten::_scaled_mm", [[16, 64], [64, 32], [], [], [], [], [], []],
                            ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", F32, F32, "", "", "Scalar", "Scalar"],
                            ["", "", "", "", "", "", "15", "False"])
    assert flops == 2 * 16 * 64 * 32 and nbytes == 16 * 64 + 64 * 32 + 16 * 32 * 2
    assert op_cost("aten::mm", [[8, 256], [128, 512]], [F32, F32]) is None  # inner dims disagree
    assert op_cost("aten::mm", [[], []], ["Scalar", "Scalar"]) is None


def test_decode_attention_with_grouped_kv_heads_and_a_mask():
    # q [2, 8, 1, 64]; k, v [2, 2, 100, 64] (GQA: 2 KV heads); mask [2, 1, 1, 100] bf16.
    flops, nbytes = op_cost("aten::scaled_dot_product_attention",
                            [[2, 8, 1, 64], [2, 2, 100, 64], [2, 2, 100, 64], [2, 1, 1, 100], [], [], [], []],
                            [BF16, BF16, BF16, BF16, "Scalar", "Scalar", "", "Scalar"])
    assert flops == 2 * 2 * 8 * 1 * 100 * (64 + 64)
    assert nbytes == (2 * 8 * 64 + 2 * 2 * 2 * 100 * 64 + 2 * 100 + 2 * 8 * 64) * 2


def test_gathers_read_only_the_rows_they_look_up():
    # embedding(W [32000, 512] bf16, ids [4, 7] int64): 28 rows read and written, plus the ids.
    assert bytes_of("aten::embedding", [[32000, 512], [4, 7], [], [], []], [BF16, I64, "Scalar", "Scalar", "Scalar"],
                    ["", "", "-1", "False", "False"]) == 2 * 28 * 512 * 2 + 28 * 8
    assert bytes_of("aten::index_select", [[100, 16], [], [5]], [F32, "Scalar", I64], ["", "0", ""]) \
        == 2 * 5 * 16 * 4 + 5 * 8


def test_what_cannot_be_modelled_is_none():
    assert op_cost("aten::unknown_op", [[4, 4]], [F32]) is None
    assert op_cost("aten::add", [[4, 4], [4, 4]], ["c10::Float4_e2m1fn_x2", F32]) is None  # unknown first type
    assert op_cost("aten::cat", [[[4, 8], [4, 8]], []], ["TensorList", "Scalar"]) is None  # no element type
    for dims, types in ([["x"]], [F32]), ("dims", "types"), ([[-4, 2]], [F32]), ([[4]], None):
        assert op_cost("aten::neg", dims, types) is None


# --- the real profiler: each op counted once, at the level that does the work ----------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    weight, bias = torch.randn(512, 256), torch.randn(512)
    other = torch.randn(64, 256)
    path = tmp_path_factory.mktemp("bytes") / "forms.json"
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
          phase("decode_step", request_ids=["r1"])):
        x.mean(dim=-1, keepdim=True)
        x.to(torch.bfloat16)
        torch.nn.functional.linear(x, weight, bias)
        other.add_(x)
        x.softmax(-1)
    prof.export_chrome_trace(str(path))
    return path


def test_profiled_forms_are_counted_once_with_hand_computed_bytes(recorded: Path):
    points = analyse(load_trace(recorded), device="cpu").kernels
    by_op = {}
    for p in points:
        assert p["op"] not in by_op, f"{p['op']} counted twice"
        by_op[p["op"]] = p["bytes"]
    n = 64 * 256
    assert by_op == {
        "aten::mean": n * 4 + 64 * 4,
        "aten::to": n * 4 + n * 2,  # not also its _to_copy and copy_
        "aten::linear": (n + 512 * 256 + 512 + 64 * 512) * 4,  # not also the addmm and bias copy_ inside
        "aten::add_": 3 * n * 4,
        "aten::softmax": 2 * n * 4,  # not also _softmax
    }
