"""Accuracy checks shared by the registry's startup self-test and the test suite: the one tolerance
table, the error measures (relative L2 error and max abs error against a float64 reference), and a
random-input generator for every op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import reference

# dtype -> (max relative L2 error ||out-ref||/||ref||, elementwise atol, elementwise rtol).
# Set from what rounding the output once to the dtype costs (fp16 eps 2^-10, bf16 2^-7) with headroom
# for fp32 accumulation order; a fused kernel must be as good as the reference cast once.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float32: (1e-5, 1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class ErrorReport:
    rel_l2: float
    max_abs: float
    ok: bool
    reason: str

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAIL ({self.reason})"
        return f"rel_l2={self.rel_l2:.2e} max_abs={self.max_abs:.2e} {verdict}"


def compare(out: Tensor, ref: Tensor, dtype: torch.dtype) -> ErrorReport:
    """Compare an op's output with a float64 reference. Non-finite values must sit exactly where the
    reference has the same non-finite value; a NaN anywhere else fails."""
    rel_tol, atol, rtol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return ErrorReport(float("inf"), float("inf"), False, f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o, r = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    o_finite, r_finite = torch.isfinite(o), torch.isfinite(r)
    if not torch.equal(o_finite, r_finite):
        bad = int((o_finite != r_finite).sum())
        return ErrorReport(float("nan"), float("nan"), False, f"{bad} elements differ in finiteness (NaN/Inf)")
    if not torch.equal(torch.nan_to_num(o[~o_finite], nan=0.0), torch.nan_to_num(r[~r_finite], nan=0.0)):
        return ErrorReport(float("nan"), float("nan"), False, "non-finite values differ")
    o, r = o[o_finite], r[r_finite]
    if r.numel() == 0:
        return ErrorReport(0.0, 0.0, True, "")
    diff = (o - r).abs()
    max_abs = float(diff.max())
    # The denominator is floored at an RMS of 1 (the scale of these ops' outputs): a near-zero reference
    # (GELU's far negative tail, where fp32 1 + erf cancels) must not turn tiny absolute differences into
    # huge relative ones. Above that floor this is exactly ||out - ref|| / ||ref||.
    ref_norm = max(float(r.norm()), r.numel() ** 0.5)
    rel_l2 = float((o - r).norm()) / ref_norm
    if rel_l2 > rel_tol:
        return ErrorReport(rel_l2, max_abs, False, f"rel_l2 {rel_l2:.2e} > {rel_tol:.0e}")
    excess = diff - (atol + rtol * r.abs())
    if bool((excess > 0).any()):
        return ErrorReport(rel_l2, max_abs, False, f"{int((excess > 0).sum())} elements beyond atol={atol} rtol={rtol}")
    return ErrorReport(rel_l2, max_abs, True, "")


def _randn(shape, dtype, device, gen, scale=1.0, shift=0.0) -> Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale + shift).to(device=device, dtype=dtype)


# Each generator returns (args, kwargs) for the op on fresh random, non-zero inputs of [rows, cols].
# LayerNorm inputs get a non-zero mean and spread so that centring and variance are exercised.
def _ln_inputs(rows, cols, dtype, device, gen):
    x = _randn((rows, cols), dtype, device, gen, scale=2.0, shift=0.5)
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (x, w, b, 1e-5), {}


def _bias_gelu_inputs(rows, cols, dtype, device, gen):
    return (_randn((rows, cols), dtype, device, gen, scale=2.0), _randn((cols,), dtype, device, gen)), {}


def _bias_residual_gelu_inputs(rows, cols, dtype, device, gen):
    x = _randn((rows, cols), dtype, device, gen, scale=2.0)
    return (x, _randn((cols,), dtype, device, gen), _randn((rows, cols), dtype, device, gen)), {}


def _add_ln_inputs(rows, cols, dtype, device, gen):
    x = _randn((rows, cols), dtype, device, gen, scale=2.0, shift=0.5)
    residual = _randn((rows, cols), dtype, device, gen)
    bias = _randn((cols,), dtype, device, gen, scale=0.5)
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (x, residual, bias, w, b, 1e-5), {}


def _embedding_ln_inputs(rows, cols, dtype, device, gen):
    vocab, positions, types = 97, 64, 2
    ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    pos = torch.randint(0, positions, (rows,), generator=gen).to(device)
    tt = torch.randint(0, types, (rows,), generator=gen).to(device)
    tables = [_randn((n, cols), dtype, device, gen) for n in (vocab, positions, types)]
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (ids, pos, tt, *tables, w, b, 1e-5), {}


def _linear_gelu_inputs(rows, cols, dtype, device, gen):
    # output [rows, cols] from x [rows, K] and weight [cols, K], K = cols / 4 (the FFN-in: hidden -> 4 x hidden);
    # weights at 1/sqrt(K) keep the outputs of order 1, where GELU is not linear
    k = max(cols // 4, 1)
    x = _randn((rows, k), dtype, device, gen)
    w = _randn((cols, k), dtype, device, gen, scale=k**-0.5)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (x, w, b), {}


def _linear_ln_inputs(rows, cols, dtype, device, gen):
    # output [rows, cols] = LayerNorm(x [rows, K] @ weight^T + bias + residual), K = cols / 2 (deep enough that the
    # split kernel splits K); weights at 1/sqrt(K), a residual and LayerNorm parameters away from 0 and 1
    k = max(cols // 2, 1)
    x = _randn((rows, k), dtype, device, gen)
    w = _randn((cols, k), dtype, device, gen, scale=k**-0.5)
    bias = _randn((cols,), dtype, device, gen, scale=0.5, shift=0.25)
    residual = _randn((rows, cols), dtype, device, gen, scale=2.0)
    g = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (x, w, bias, residual, g, b, 1e-5), {}


def _segment_inputs(rows, cols, dtype, device, gen):
    # `rows` packed tokens: segments of 1..2*avg-1 tokens back to back, then an empty one (a CUDA-graph bucket's
    # filler sequence), then ~1/8 of the rows as filler tokens past the last offset, set to NaN: never to be read
    real = rows - rows // 8
    avg = max(1, min(128, real // 4))
    lengths: list[int] = []
    while sum(lengths) < real:
        lengths.append(min(int(torch.randint(1, 2 * avg, (1,), generator=gen)), real - sum(lengths)))
    offsets = torch.tensor([0, *itertools.accumulate([*lengths, 0])], dtype=torch.int32, device=device)
    x = _randn((rows, cols), dtype, device, gen, scale=2.0, shift=0.5)
    x[real:] = float("nan")
    return (x, offsets), {}


def attention_heads(cols: int) -> int:
    """A head count for a [*, cols] attention test: the fewest heads, at most 16, of at most 128 columns that split
    the width (384 -> 3 heads of 128, 300 -> 3 of 100, 1023 -> 11 of 93, 7 -> 1 of 7), else one head (769, 4097: the
    kernels then take the torch path). Few heads keep the interpreter quick (its cost is per program, and programs
    are sequences x heads); the model's own head widths (32 and 64) are the GPU tests' shapes."""
    return next((h for h in range(1, 17) if cols % h == 0 and cols // h <= 128), 1)


def _qkv_attention_inputs(rows, cols, dtype, device, gen):
    # `rows` packed tokens: sequences of 1..2*avg-1 tokens, an empty one (a graph bucket's filler sequence), then
    # ~1/8 of the rows as filler tokens past the last offset (zeros out). Weights at 1/sqrt(cols) give q k^T / sqrt(d)
    # of order 1: softmax neither uniform nor one-hot. max_seqlen is a loose bound (a graph bucket's), not the longest.
    real = rows - rows // 8
    avg = max(1, min(64, real // 3))
    lengths: list[int] = []
    while sum(lengths) < real:
        lengths.append(min(int(torch.randint(1, 2 * avg, (1,), generator=gen)), real - sum(lengths)))
    offsets = torch.tensor([0, *itertools.accumulate([*lengths, 0])], dtype=torch.int32, device=device)
    x = _randn((rows, cols), dtype, device, gen)
    w = _randn((3 * cols, cols), dtype, device, gen, scale=cols**-0.5)
    b = _randn((3 * cols,), dtype, device, gen, scale=0.5)
    max_seqlen = -(-max(lengths) // 16) * 16
    return (x, w, b, offsets, max_seqlen, attention_heads(cols)), {}


def _attention_partials_inputs(rows, cols, dtype, device, gen):
    (x, w, b, offsets, max_seqlen, heads), _ = _qkv_attention_inputs(rows, cols, dtype, device, gen)
    out_weight = _randn((cols, cols), dtype, device, gen, scale=cols**-0.5)
    return (x, w, b, offsets, max_seqlen, heads, out_weight), {}


def _ffn_partials_inputs(rows, cols, dtype, device, gen):
    # the FFN at 4 x width, at most 300 (a 4097-wide row still tests the kernel's column loops, without a 67M-element
    # weight; and the interpreter's self-test stays quick), split into chunks of odd sizes (300 -> 12 of 25 columns)
    inner = min(4 * cols, 300)
    x = _randn((rows, cols), dtype, device, gen)
    w1 = _randn((inner, cols), dtype, device, gen, scale=cols**-0.5)
    b1 = _randn((inner,), dtype, device, gen, scale=0.5)
    w2 = _randn((cols, inner), dtype, device, gen, scale=inner**-0.5)
    splits = next(s for s in (16, 12, 8, 4, 2, 1) if inner % s == 0)
    return (x, w1, b1, w2, splits), {}


def _partial_ln_inputs(rows, cols, dtype, device, gen):
    # 3 fp32 partial sums (float64 stays float64) that add up to a non-zero mean and spread
    parts = _randn((3, rows, cols), torch.float64 if dtype == torch.float64 else torch.float32, device, gen,
                   scale=0.7, shift=0.1)
    residual = _randn((rows, cols), dtype, device, gen)
    bias = _randn((cols,), dtype, device, gen, scale=0.5)
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (parts, bias, residual, w, b, 1e-5), {}


def _per_head(args, rows, cols, dtype):
    return (args[5], rows, cols), (torch.float64 if dtype == torch.float64 else torch.float32)


def _per_split(args, rows, cols, dtype):
    return (args[4], rows, cols), (torch.float64 if dtype == torch.float64 else torch.float32)


def _same_as_input(args, rows, cols, dtype):
    return (rows, cols), dtype


def _per_segment(args, rows, cols, dtype):
    return (args[1].numel() - 1, cols), (torch.float64 if dtype == torch.float64 else torch.float32)


@dataclass(frozen=True)
class OpSpec:
    name: str
    reference: Callable[..., Tensor]
    make_inputs: Callable[..., tuple[tuple, dict]]
    rowwise: bool = True  # the first argument is [rows, cols] like the output (not so for a GEMM)
    race_cols: Callable[[int], int] = lambda hidden: hidden  # output width at a model's hidden size
    # (args, rows, cols, dtype) -> the output's (shape, dtype): [rows, cols] in the input dtype unless said
    output: Callable[..., tuple[tuple[int, ...], torch.dtype]] = _same_as_input
    fused_in: tuple[str, ...] = ("triton", "cuda")  # the fused backends that implement it


def ops_of(backend: str) -> list[str]:
    """The ops a fused backend implements (the registry runs the rest on the reference when it is forced)."""
    return [op for op, spec in OP_SPECS.items() if backend in spec.fused_in]


OP_SPECS: dict[str, OpSpec] = {
    "layer_norm": OpSpec("layer_norm", reference.layer_norm, _ln_inputs),
    "layer_norm_gelu": OpSpec("layer_norm_gelu", reference.layer_norm_gelu, _ln_inputs),
    "bias_gelu": OpSpec("bias_gelu", reference.bias_gelu, _bias_gelu_inputs),
    "bias_residual_gelu": OpSpec("bias_residual_gelu", reference.bias_residual_gelu, _bias_residual_gelu_inputs),
    "add_layer_norm": OpSpec("add_layer_norm", reference.add_layer_norm, _add_ln_inputs),
    "embedding_layer_norm": OpSpec("embedding_layer_norm", reference.embedding_layer_norm, _embedding_ln_inputs),
    "linear_bias_gelu": OpSpec("linear_bias_gelu", reference.linear_bias_gelu, _linear_gelu_inputs, rowwise=False,
                               race_cols=lambda hidden: 4 * hidden),
    "linear_add_layer_norm": OpSpec("linear_add_layer_norm", reference.linear_add_layer_norm, _linear_ln_inputs,
                                    rowwise=False),
    # mean pooling of a packed batch: [rows tokens, cols] -> [segments, cols] float32
    "segment_mean": OpSpec("segment_mean", reference.segment_mean, _segment_inputs, rowwise=False,
                           output=_per_segment),
    # a layer's QKV projection + attention over each packed sequence: [rows tokens, cols] -> [rows, cols]
    "qkv_attention": OpSpec("qkv_attention", reference.qkv_attention, _qkv_attention_inputs, rowwise=False,
                            fused_in=("triton",)),
    # the few-token layer's pieces: attention + each head's share of the output projection -> [heads, rows, cols]
    # fp32; the FFN split over its intermediate width -> [splits, rows, cols] fp32; their LayerNorm over the sum
    "attention_partials": OpSpec("attention_partials", reference.attention_partials, _attention_partials_inputs,
                                 rowwise=False, output=_per_head, fused_in=("triton",)),
    "ffn_partials": OpSpec("ffn_partials", reference.ffn_partials, _ffn_partials_inputs, rowwise=False,
                           output=_per_split, fused_in=("triton",)),
    "partial_add_layer_norm": OpSpec("partial_add_layer_norm", reference.partial_add_layer_norm, _partial_ln_inputs,
                                     rowwise=False, fused_in=("triton",)),
}
ROWWISE_OPS = tuple(op for op, spec in OP_SPECS.items() if spec.rowwise)
assert set(OP_SPECS) == set(reference.OPS)


def to_float64(value):
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().to("cpu", torch.float64)
    if isinstance(value, Tensor):
        return value.detach().cpu()
    return value


def float64_reference(op: str, args: tuple, kwargs: dict) -> Tensor:
    """The op's reference evaluated in float64 on the CPU, on exactly the (already rounded) inputs."""
    return OP_SPECS[op].reference(*map(to_float64, args), **kwargs)


def check_op(fn: Callable[..., Tensor], op: str, rows: int, cols: int, dtype: torch.dtype,
             device: torch.device | str, seed: int) -> ErrorReport:
    """Run `fn` (a backend's implementation of `op`) on fresh random inputs into a NaN-poisoned output
    and compare it with the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    spec = OP_SPECS[op]
    args, kwargs = spec.make_inputs(rows, cols, dtype, device, gen)
    shape, out_dtype = spec.output(args, rows, cols, dtype)
    out = torch.full(shape, float("nan"), dtype=out_dtype, device=device)
    result = fn(*args, **kwargs, out=out)
    if result.data_ptr() != out.data_ptr():
        return ErrorReport(float("nan"), float("nan"), False, "did not write into the out= tensor")
    return compare(result, float64_reference(op, args, kwargs), dtype)
