"""FLOPs and the minimum bytes an op must move, from its record_shapes args.

Each tensor counts at its own element size (a bf16 -> fp32 copy reads 2 bytes and writes 4
per element); an input broadcast by expand (stride 0, from `Input Strides`) is read once;
a reduction writes the reduced shape, not the input's; an in-place op writes its first
argument and nothing else; `Concrete Inputs` give the reduced dims and target dtypes.
The bytes are a lower bound on the traffic (caches aside), so bytes / time is a lower
bound on the bandwidth the op reached: a figure above the device's peak means the model
or the device is wrong, never the op.

Ops that wrap others (aten::linear -> addmm, aten::to -> _to_copy -> copy_, mean -> sum)
are modelled at the outermost level that can be; the detector skips what they contain.
"""

from __future__ import annotations

import math
import re
from typing import Any

ELEMENT_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2,
    "long int": 8, "long": 8, "long long": 8, "int64_t": 8, "__int64": 8,
    "int": 4, "short int": 2, "short": 2, "bool": 1, "signed char": 1, "unsigned char": 1,
    "short unsigned int": 2, "unsigned short": 2, "unsigned int": 4, "long unsigned int": 8, "unsigned long": 8,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1, "c10::qint8": 1, "c10::quint8": 1, "c10::qint32": 4,
    "c10::complex<c10::Half>": 4, "c10::complex<float>": 8, "c10::complex<double>": 16,
}
# c10::ScalarType codes, as `Concrete Inputs` write a dtype argument (checked against torch 2.13).
SCALAR_TYPE_BYTES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 8: 4, 9: 8, 10: 16, 11: 1, 12: 1, 13: 1,
                     14: 4, 15: 2, 23: 1, 24: 1, 25: 1, 26: 1, 27: 2, 28: 4, 29: 8, 44: 1}

GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                   "aten::mv", "aten::addmv", "aten::_scaled_mm"})
ATTENTION = frozenset({"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                       "aten::_scaled_dot_product_efficient_attention",
                       "aten::_scaled_dot_product_cudnn_attention",
                       "aten::_scaled_dot_product_flash_attention_for_cpu"})
# Reductions: op -> index of the `dim` argument.
REDUCTIONS = {"aten::sum": 1, "aten::mean": 1, "aten::amax": 1, "aten::amin": 1, "aten::prod": 1,
              "aten::logsumexp": 1, "aten::var": 1, "aten::std": 1, "aten::argmax": 1, "aten::argmin": 1,
              "aten::max": 1, "aten::min": 1, "aten::all": 1, "aten::any": 1, "aten::linalg_vector_norm": 2,
              "aten::norm": 2}
_INT_DIM_REDUCTIONS = frozenset({"aten::argmax", "aten::argmin", "aten::max", "aten::min", "aten::prod",
                                 "aten::all", "aten::any"})  # `dim` is one int, not a list
_INDEX_OUTPUT = frozenset({"aten::argmax", "aten::argmin"})
_VALUES_AND_INDICES = frozenset({"aten::max", "aten::min"})
_BOOL_OUTPUT = frozenset({"aten::all", "aten::any", "aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt",
                          "aten::ge", "aten::isnan", "aten::isinf", "aten::logical_not", "aten::logical_and",
                          "aten::logical_or"})
SAME_SHAPE = frozenset({"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax",
                        "aten::cumsum"})
NORMS = frozenset({"aten::layer_norm", "aten::native_layer_norm", "aten::rms_norm", "aten::_fused_rms_norm"})
COPIES = frozenset({"aten::copy_", "aten::to", "aten::_to_copy"})
FILLS = frozenset({"aten::fill_", "aten::zero_"})
REPEATS = frozenset({"aten::repeat_interleave"})  # (its index_select inside is part of it)
EMBEDDINGS = frozenset({"aten::embedding"})
INDEXING = frozenset({"aten::index_select", "aten::gather", "aten::take_along_dim"})
GATHERS = EMBEDDINGS | INDEXING
# Ops over a list of tensors: the profiler records no element type for a list ("TensorList"), so
# their bytes need the type from elsewhere (list_ops.py finds it on the op that reads the result).
LISTS = frozenset({"aten::cat", "aten::stack"})
ELEMENTWISE = frozenset({
    "aten::add", "aten::sub", "aten::mul", "aten::div", "aten::pow", "aten::maximum", "aten::minimum",
    "aten::where", "aten::masked_fill", "aten::addcmul", "aten::addcdiv", "aten::lerp", "aten::clamp",
    "aten::clamp_min", "aten::clamp_max", "aten::neg", "aten::abs", "aten::exp", "aten::log", "aten::sqrt",
    "aten::rsqrt", "aten::reciprocal", "aten::sin", "aten::cos", "aten::tanh", "aten::sigmoid", "aten::erf",
    "aten::silu", "aten::gelu", "aten::relu", "aten::square", *_BOOL_OUTPUT - {"aten::all", "aten::any"},
    "aten::add_", "aten::sub_", "aten::mul_", "aten::div_", "aten::pow_", "aten::neg_", "aten::exp_",
    "aten::sqrt_", "aten::rsqrt_", "aten::clamp_", "aten::clamp_min_", "aten::masked_fill_", "aten::silu_",
    "aten::gelu_", "aten::relu_", "aten::sigmoid_", "aten::tanh_", "aten::addcmul_", "aten::lerp_",
})
MODELLED = (GEMMS | ATTENTION | set(REDUCTIONS) | SAME_SHAPE | NORMS | COPIES | FILLS | GATHERS | ELEMENTWISE
            | LISTS | REPEATS)
# A join is "growing" a tensor when one part holds this share of the result: a cache extended by cat.
GROWN_SHARE = 0.9

Cost = tuple[float, float]  # (FLOPs, bytes)


def op_family(name: str, dims: Any = None, concrete: Any = None) -> str:
    """What kind of work an op is, for the remedy a finding suggests; ``dims`` and ``concrete`` (its
    Input Dims and Concrete Inputs) tell a reorder from other indexing and a growing cat from a join."""
    if name in GEMMS:
        return "attention_matmul" if _two_4d_operands(name, dims) else "gemm"
    if name in ATTENTION:
        return "attention"
    if name in COPIES:
        return "copy"
    if name in EMBEDDINGS:
        return "embedding"
    if name in INDEXING:
        return "reorder" if _reorders_rows(name, dims, concrete) else "index"
    if name in REPEATS:
        return "repeat"
    if name in LISTS:
        return "join"  # (mark_growing tells the cats that grow a tensor step after step)
    if name in REDUCTIONS or name in SAME_SHAPE or name in NORMS:
        return "reduction"
    return "elementwise"


def _two_4d_operands(name: str, dims: Any) -> bool:
    """matmul of two [batch, heads, rows, cols] tensors: no weight is 4-D, so both are activations, as
    in attention written out by hand (q @ k.transpose(-2, -1), then the probabilities @ v)."""
    a, b = arg_at(dims, 0), arg_at(dims, 1)
    return name == "aten::matmul" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 4


def _reorders_rows(name: str, dims: Any, concrete: Any) -> bool:
    """index_select(x, 0, idx) with as many indices as x has rows, x of 3+ dims: every row copied to a
    new order (beam search's per-step reorder of a KV cache, [beams, heads, positions, head dim]).
    A 2-D one is not told apart from a server selecting its tokens' rows ([tokens, hidden]) for
    the logits: "index"."""
    if name != "aten::index_select" or not isinstance(dims, list) or len(dims) < 3:
        return False
    table, index = dims[0], dims[2]
    return (isinstance(table, list) and len(table) >= 3 and isinstance(index, list) and len(index) == 1
            and index[0] == table[0] and int_of(arg_at(concrete, 1)) == 0)


class _Tensor:
    """One tensor argument: its dims, element size, and the elements it really holds."""

    __slots__ = ("dims", "type_name", "elem", "numel", "stored")

    def __init__(self, dims: list[int], type_name: str, strides: Any) -> None:
        self.dims, self.type_name, self.elem = dims, type_name, ELEMENT_BYTES[type_name]
        self.numel = math.prod(dims)
        # An expanded (broadcast) view repeats elements along its stride-0 dims: read once.
        if isinstance(strides, list) and len(strides) == len(dims) and all(type(s) is int for s in strides):
            self.stored = math.prod(d for d, s in zip(dims, strides, strict=True) if s != 0)
        else:
            self.stored = self.numel

    @property
    def nbytes(self) -> int:
        return self.stored * self.elem


def _tensor(dims: Any, type_name: Any, strides: Any = None) -> _Tensor | None:
    """A tensor argument, or None for scalars, lists, None and unknown element types."""
    if not isinstance(dims, list) or not isinstance(type_name, str) or type_name not in ELEMENT_BYTES:
        return None
    if not all(type(d) is int and d >= 0 for d in dims):
        return None
    return _Tensor(dims, type_name, strides)


def arg_at(values: Any, index: int) -> Any:
    return values[index] if isinstance(values, list) and 0 <= index < len(values) else None


def int_of(text: Any) -> int | None:
    try:
        return int(text) if isinstance(text, str) and text.strip() else None
    except ValueError:
        return None


def _int_list(text: Any) -> list[int] | None:
    """'[0, -1]' -> [0, -1]; '-1' -> [-1]; '' / None -> None."""
    if not isinstance(text, str) or not text.strip():
        return None
    numbers = re.findall(r"-?\d+", text)
    if text.strip().startswith("[") or len(numbers) == 1:
        return [int(n) for n in numbers]
    return None


def _dtype_bytes(concrete: Any, index: int) -> int | None:
    code = int_of(arg_at(concrete, index))
    return SCALAR_TYPE_BYTES.get(code) if code is not None else None


def _broadcast(shapes: list[list[int]]) -> list[int] | None:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for i, d in enumerate(shape, start=rank - len(shape)):
            if d != 1:
                if out[i] not in (1, d):
                    return None  # not broadcastable: the args are not what this model assumes
                out[i] = d
    return out


def op_cost(name: str, dims: Any, types: Any, concrete: Any = None, strides: Any = None) -> Cost | None:
    """(FLOPs, minimum bytes moved) of one op from its record_shapes args; None when it cannot
    be modelled (unknown op, missing shapes, an element type or argument it does not know)."""
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    tensors = [_tensor(d, t, arg_at(strides, i)) for i, (d, t) in enumerate(zip(dims, types, strict=False))]
    model = _MODELS.get(name) or (_elementwise if name in ELEMENTWISE else None)
    if model is None or not tensors or tensors[0] is None:
        return None
    try:
        cost = model(name, tensors, concrete, types)
    except (ValueError, TypeError, IndexError, OverflowError):
        return None
    if cost is None or not all(math.isfinite(v) and v >= 0 for v in cost) or cost[1] <= 0:
        return None
    return float(cost[0]), float(cost[1])


def _gemm(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    bias: _Tensor | None = None
    if name == "aten::linear":  # linear(input [..., K], weight [N, K], bias [N]?)
        a, weight, bias = tensors[0], arg_at(tensors, 1), arg_at(tensors, 2)
        if a is None or weight is None or len(weight.dims) != 2 or not a.dims or a.dims[-1] != weight.dims[1]:
            return None
        m, k, n = math.prod(a.dims[:-1]), weight.dims[1], weight.dims[0]
        flops = 2.0 * m * n * k + (m * n if bias is not None else 0)
        return flops, a.nbytes + weight.nbytes + (bias.nbytes if bias else 0) + m * n * a.elem
    if name in ("aten::addmm", "aten::baddbmm", "aten::addmv"):  # bias (broadcast), then the product
        bias, a, b = tensors[0], arg_at(tensors, 1), arg_at(tensors, 2)
    elif name == "aten::_scaled_mm":  # (a, b, scale_a, scale_b, bias?, scale_result?, out_dtype?, ...)
        a, b, bias = tensors[0], arg_at(tensors, 1), arg_at(tensors, 4)
    else:
        a, b = tensors[0], arg_at(tensors, 1)
    if a is None or b is None or not a.dims or not b.dims:
        return None
    m = a.dims[-2] if len(a.dims) > 1 else 1
    k = a.dims[-1]
    n = b.dims[-1] if len(b.dims) > 1 else 1
    if k != (b.dims[-2] if len(b.dims) > 1 else b.dims[0]):
        return None
    if len(b.dims) == 2:  # a's leading dims are more rows of the same product
        batch, m = 1, math.prod(a.dims[:-1])
    elif len(b.dims) == 1:  # matrix (or a batch of them) times a vector
        batch = math.prod(a.dims[:-2])
    else:
        lead = _broadcast([a.dims[:-2], b.dims[:-2]])
        if lead is None:
            return None
        batch = math.prod(lead)
    out_elem = (_dtype_bytes(concrete, 6) or a.elem) if name == "aten::_scaled_mm" else a.elem
    flops = 2.0 * batch * m * n * k + (batch * m * n if bias is not None else 0)
    reads = a.nbytes + b.nbytes + (bias.nbytes if bias is not None else 0)
    return flops, reads + batch * m * n * out_elem


def _attention(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    q, k, v = tensors[0], arg_at(tensors, 1), arg_at(tensors, 2)
    if q is None or k is None or v is None or len(q.dims) != 4 or len(k.dims) != 4 or len(v.dims) != 4:
        return None
    b, h, sq, dqk = q.dims
    sk, dv = k.dims[-2], v.dims[-1]
    flops = 2.0 * b * h * sq * sk * (dqk + dv)
    mask = arg_at(tensors, 3)  # SDPA's attn_mask, when given as a tensor
    reads = q.nbytes + k.nbytes + v.nbytes + (mask.nbytes if mask is not None else 0)
    return flops, reads + b * h * sq * dv * q.elem


def _reduced_numel(name: str, x: _Tensor, concrete: Any, types: list[Any]) -> int:
    position = REDUCTIONS[name]
    if name in _INT_DIM_REDUCTIONS:
        # dim is one int, and present only in the dim overloads (max(self) reduces everything).
        dim = int_of(arg_at(concrete, position)) if len(types) > 2 else None
        reduced = [dim] if dim is not None else None
    else:  # a dim list; sum(self, dtype) has a dtype (a Scalar) where the list would be
        reduced = _int_list(arg_at(concrete, position)) if arg_at(types, position) == "ScalarList" else None
    if not reduced or not x.dims:  # no dims (or []) = reduce over all of them
        return 1
    rank = len(x.dims)
    axes = {d % rank for d in reduced if -rank <= d < rank}
    return math.prod(d for i, d in enumerate(x.dims) if i not in axes)


def _reduction(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    x = tensors[0]
    assert x is not None
    if name in _VALUES_AND_INDICES and arg_at(tensors, 1) is not None:  # max(a, b): element-wise
        return _elementwise(name, tensors, concrete, types)
    out = _reduced_numel(name, x, concrete, types)
    if name in _INDEX_OUTPUT:
        out_bytes = out * 8
    elif name in _VALUES_AND_INDICES and len(tensors) > 2:
        out_bytes = out * (x.elem + 8)
    elif name in _BOOL_OUTPUT:
        out_bytes = out
    else:
        dtype_at = {"aten::sum": 3, "aten::mean": 3, "aten::prod": 3, "aten::linalg_vector_norm": 4}.get(name, -1)
        if len(types) == 2 and name in ("aten::sum", "aten::mean", "aten::prod"):
            dtype_at = 1  # sum(self, dtype)
        out_bytes = out * (_dtype_bytes(concrete, dtype_at) or x.elem)
    return float(x.numel), x.nbytes + out_bytes


def _same_shape(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    x = tensors[0]
    assert x is not None
    out_elem = x.elem
    if name in ("aten::softmax", "aten::log_softmax"):
        out_elem = _dtype_bytes(concrete, 2) or x.elem
    elif name in ("aten::_softmax", "aten::_log_softmax") and arg_at(concrete, 2) == "True":
        out_elem = 4  # half_to_float
    return 5.0 * x.numel, x.nbytes + x.numel * out_elem


def _norm(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    x = tensors[0]
    assert x is not None
    params = sum(t.nbytes for t in tensors[1:] if t is not None)  # weight and bias, when given
    return 5.0 * x.numel, x.nbytes + params + x.numel * x.elem


def _copy(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    if name == "aten::copy_":
        dst, src = tensors[0], arg_at(tensors, 1)
        if dst is None or src is None:
            return None
        return 0.0, dst.numel * dst.elem + src.nbytes
    src = tensors[0]
    assert src is not None
    # to(self, dtype, ...), to(self, device, dtype, ...) (6 args), _to_copy(self, dtype, ...)
    other = arg_at(tensors, 1)
    dst_elem = other.elem if other is not None else _dtype_bytes(concrete, 2 if len(tensors) == 6 else 1)
    if dst_elem is None or dst_elem == src.elem:
        return None  # same dtype: often no copy at all (to() returns self); the copy_ inside says
    return 0.0, src.nbytes + src.numel * dst_elem


def _fill(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    x = tensors[0]
    assert x is not None
    return float(x.numel), x.numel * x.elem


def _gather(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    table = tensors[0]
    assert table is not None
    if name == "aten::embedding":
        index = arg_at(tensors, 1)
        if index is None or len(table.dims) != 2:
            return None
        rows = index.numel * table.dims[1]
    elif name == "aten::index_select":  # index_select(self, dim, index)
        index, dim = arg_at(tensors, 2), int_of(arg_at(concrete, 1))
        if index is None or dim is None or not table.dims or not -len(table.dims) <= dim < len(table.dims):
            return None
        rows = table.numel // max(table.dims[dim], 1) * index.numel
    else:  # gather(self, dim, index), take_along_dim(self, indices, dim?): one element per index
        index = arg_at(tensors, 2 if name == "aten::gather" else 1)
        if index is None:
            return None
        rows = index.numel if name == "aten::gather" else _along_numel(table, index, concrete)
        if rows is None:
            return None
    return 0.0, 2 * rows * table.elem + index.nbytes  # elements read, the same written, the indices


def _repeat(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    """repeat_interleave(self, repeats: int, dim?): self read, ``repeats`` copies of it written (a
    tensor of repeats, each element its own count, is not modelled)."""
    x = tensors[0]
    assert x is not None
    repeats = int_of(arg_at(concrete, 1)) if arg_at(types, 1) == "Scalar" else None
    if repeats is None or repeats < 1:
        return None
    return 0.0, x.nbytes + x.numel * repeats * x.elem


def _along_numel(table: _Tensor, index: _Tensor, concrete: Any) -> int | None:
    """take_along_dim's result size: the indices' dims along `dim`, the others broadcast with self's
    (no dim: self flattened, one element per index)."""
    dim = int_of(arg_at(concrete, 2))
    if dim is None:
        return index.numel
    rank = len(table.dims)
    if len(index.dims) != rank or not -rank <= dim < rank:
        return None
    at = dim % rank
    shape = _broadcast([table.dims[:at] + table.dims[at + 1:], index.dims[:at] + index.dims[at + 1:]])
    return None if shape is None else math.prod(shape) * index.dims[at]


def _elementwise(name: str, tensors: list[_Tensor | None], concrete: Any, types: list[Any]) -> Cost | None:
    # A tensor past the op's inputs is its out= argument (mul.out: [self, other, out]): written, not read.
    arity = _INPUT_TENSORS.get(name.rstrip("_"), len(tensors))
    inputs = [t for t in tensors[:arity] if t is not None]
    given = next((t for t in tensors[arity:] if t is not None), None)
    reads = sum(t.nbytes for t in inputs)
    if name.endswith("_"):  # in place: the first argument is read and written back
        self_ = inputs[0]
        return float(self_.numel), reads + self_.numel * self_.elem
    shape = _broadcast([t.dims for t in inputs])
    if shape is None:
        return None
    out = math.prod(shape)
    if given is not None:
        return float(out), reads + given.numel * given.elem
    out_elem = 1 if name in _BOOL_OUTPUT else _promoted_elem(inputs)
    return float(out), reads + out * out_elem


def _promoted_elem(inputs: list[_Tensor]) -> int:
    """Element size of an elementwise op's result, by torch's type promotion: the tensors with
    dims decide within their category (bf16 * 0.125 is bf16: the Python float is recorded as a
    0-dim "double"); a 0-dim input of a higher category (an int tensor * 0.5) raises it, to that
    category's default dtype (a wrapped Python number, which record_shapes cannot tell from a
    0-dim tensor, is the usual case)."""
    dimensioned = [t for t in inputs if t.dims] or inputs
    top = max(_category(t) for t in dimensioned)
    elem = max(t.elem for t in dimensioned if _category(t) == top)
    higher = [t for t in inputs if not t.dims and _category(t) > top]
    if higher and dimensioned is not inputs:
        elem = _DEFAULT_ELEM[max(_category(t) for t in higher)]
    return elem


def _category(tensor: _Tensor) -> int:
    """torch's promotion categories: bool 0 < integer 1 < floating 2 < complex 3."""
    name = tensor.type_name
    if name.startswith("c10::complex"):
        return 3
    if name in _FLOAT_TYPES or name.startswith("c10::Float8"):
        return 2
    return 0 if name == "bool" else 1


_FLOAT_TYPES = frozenset({"double", "float", "c10::Half", "c10::BFloat16"})
# How many leading arguments of each element-wise op can be tensors it reads (their schemas, less
# out=): add's alpha and addcmul's value are scalars, masked_fill's value and clamp's bounds may be
# 0-dim or full tensors. Ops not listed: every argument is read.
_INPUT_TENSORS = {
    **dict.fromkeys(("aten::neg", "aten::abs", "aten::exp", "aten::log", "aten::sqrt", "aten::rsqrt",
                     "aten::reciprocal", "aten::sin", "aten::cos", "aten::tanh", "aten::sigmoid", "aten::erf",
                     "aten::silu", "aten::gelu", "aten::relu", "aten::square", "aten::isnan", "aten::isinf",
                     "aten::logical_not"), 1),
    **dict.fromkeys(("aten::add", "aten::sub", "aten::mul", "aten::div", "aten::pow", "aten::maximum",
                     "aten::minimum", "aten::clamp_min", "aten::clamp_max", "aten::eq", "aten::ne", "aten::lt",
                     "aten::le", "aten::gt", "aten::ge", "aten::logical_and", "aten::logical_or"), 2),
    **dict.fromkeys(("aten::where", "aten::masked_fill", "aten::addcmul", "aten::addcdiv", "aten::lerp",
                     "aten::clamp"), 3),
}
_DEFAULT_ELEM = {1: 8, 2: 4, 3: 8}  # int64, float32 (torch's default dtype), complex64

_MODELS = {
    **dict.fromkeys(GEMMS, _gemm), **dict.fromkeys(ATTENTION, _attention), **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(SAME_SHAPE, _same_shape), **dict.fromkeys(NORMS, _norm), **dict.fromkeys(COPIES, _copy),
    **dict.fromkeys(FILLS, _fill), **dict.fromkeys(GATHERS, _gather), **dict.fromkeys(REPEATS, _repeat),
}
