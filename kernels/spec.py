"""The op list, once. Each fused op's entry names its torch reference (whose signature is the op's signature:
the public wrappers in kernels/__init__.py, the torch.library schema in kernels/library.py and the launchers of
every backend follow it), its documentation, its fake (meta) implementation, the backends that implement it and the
module holding each one's launcher, and how the registry's self-test and the test suite build fresh random inputs
for it. Adding an op touches this file, kernels/reference.py and the backends' launchers, nothing else.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fusedserve.kernels import reference


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


def _rms_inputs(rows, cols, dtype, device, gen):
    # a non-zero mean: RMSNorm does not centre, so the mean is part of the scale; Qwen's eps
    x = _randn((rows, cols), dtype, device, gen, scale=2.0, shift=0.5)
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    return (x, w, 1e-6), {}


def _add_rms_inputs(rows, cols, dtype, device, gen):
    x = _randn((rows, cols), dtype, device, gen, scale=2.0, shift=0.5)
    residual = _randn((rows, cols), dtype, device, gen)
    w = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    return (x, residual, w, 1e-6), {}


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
    # output [rows, cols] = LayerNorm(x [rows, K] @ weight^T + bias + residual), K = cols / 2 (a real reduction
    # depth); weights at 1/sqrt(K), a residual and LayerNorm parameters away from 0 and 1
    k = max(cols // 2, 1)
    x = _randn((rows, k), dtype, device, gen)
    w = _randn((cols, k), dtype, device, gen, scale=k**-0.5)
    bias = _randn((cols,), dtype, device, gen, scale=0.5, shift=0.25)
    residual = _randn((rows, cols), dtype, device, gen, scale=2.0)
    g = _randn((cols,), dtype, device, gen, scale=0.5, shift=1.0)
    b = _randn((cols,), dtype, device, gen, scale=0.5)
    return (x, w, bias, residual, g, b, 1e-5), {}


def _packed(rows, longest, parts, device, gen) -> tuple[int, list[int], Tensor]:
    """A packed batch's shape over `rows` tokens: ~7/8 of them real, in segments of 1..2*avg-1 tokens (avg = real /
    parts, at most `longest`), then an empty segment (a CUDA-graph bucket's filler sequence); the rest are filler
    tokens past the last offset. Returns (real tokens, lengths, int32 offsets [segments + 2])."""
    real = rows - rows // 8
    avg = max(1, min(longest, real // parts))
    lengths: list[int] = []
    while sum(lengths) < real:
        lengths.append(min(int(torch.randint(1, 2 * avg, (1,), generator=gen)), real - sum(lengths)))
    offsets = torch.tensor([0, *itertools.accumulate([*lengths, 0])], dtype=torch.int32, device=device)
    return real, lengths, offsets


def _segment_inputs(rows, cols, dtype, device, gen):
    # packed segments (_packed); the filler tokens are NaN: never to be read
    real, _, offsets = _packed(rows, 128, 4, device, gen)
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
    # packed sequences (_packed; filler tokens come out as zeros). Weights at 1/sqrt(cols) give q k^T / sqrt(d) of
    # order 1: softmax neither uniform nor one-hot. max_seqlen is a loose bound (a graph bucket's), not the longest.
    _, lengths, offsets = _packed(rows, 64, 3, device, gen)
    x = _randn((rows, cols), dtype, device, gen)
    w = _randn((3 * cols, cols), dtype, device, gen, scale=cols**-0.5)
    b = _randn((3 * cols,), dtype, device, gen, scale=0.5)
    max_seqlen = -(-max(lengths) // 16) * 16
    return (x, w, b, offsets, max_seqlen, attention_heads(cols)), {}


def _relative_attention_inputs(rows, cols, dtype, device, gen):
    # packed sequences (_packed; filler tokens come out as zeros) of q, k and v stacked as [rows, 3 * cols]. Entries of
    # order 1 give q k^T / sqrt(d) of order 1, and a bias of order 1 moves the scores as much again: softmax neither
    # uniform nor one-hot. The table reaches past max_seqlen (a model's is sized by its positions, not the batch's).
    _, lengths, offsets = _packed(rows, 64, 3, device, gen)
    heads = attention_heads(cols)
    qkv = _randn((rows, 3 * cols), dtype, device, gen)
    max_seqlen = -(-max(lengths) // 16) * 16
    reach = max_seqlen + 5
    bias = _randn((heads, 2 * reach - 1), _fp32(dtype), device, gen)
    return (qkv, offsets, max_seqlen, heads, bias), {}


def _disentangled_attention_inputs(rows, cols, dtype, device, gen):
    # packed sequences (_packed; filler tokens come out as zeros) of q, k and v stacked as [rows, 3 * cols], both
    # position tables [P, cols] in the same dtype, all of order 1, and DeBERTa's scale 1 / sqrt(3 d): each of the three
    # terms of order 1 / sqrt(3), softmax neither uniform nor one-hot. The row per distance is drawn at random from the
    # table (not a monotone bucketing), so a kernel must read each distance's own row; the vector reaches past
    # max_seqlen (a model's is sized by its positions).
    _, lengths, offsets = _packed(rows, 64, 3, device, gen)
    heads = attention_heads(cols)
    qkv = _randn((rows, 3 * cols), dtype, device, gen)
    max_seqlen = -(-max(lengths) // 16) * 16
    reach, table_rows = max_seqlen + 5, 24
    pos_key, pos_query = (_randn((table_rows, cols), dtype, device, gen) for _ in range(2))
    distance_rows = torch.randint(0, table_rows, (2 * reach - 1,), generator=gen).to(device)
    return (qkv, offsets, max_seqlen, heads, pos_key, pos_query, distance_rows, (3 * (cols // heads)) ** -0.5), {}


def rotary_heads(cols: int) -> int:
    """A head count for a rotary attention test of width `cols` (even): as attention_heads, of an even head width
    (rotary pairs dimension i with i + d/2)."""
    return next((h for h in range(1, 17) if cols % h == 0 and (cols // h) % 2 == 0 and cols // h <= 128), 1)


def _rotary_attention_inputs(rows, cols, dtype, device, gen):
    # as _relative_attention_inputs, at an even width (an odd `cols` is rounded up: the output is [rows, width]);
    # the frequencies of a 10000 base at the head width, float32 as models keep them
    width = cols + cols % 2
    _, lengths, offsets = _packed(rows, 64, 3, device, gen)
    heads = rotary_heads(width)
    d = width // heads
    qkv = _randn((rows, 3 * width), dtype, device, gen)
    max_seqlen = -(-max(lengths) // 16) * 16
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).to(device=device,
                                                                                    dtype=_fp32(dtype))
    return (qkv, offsets, max_seqlen, heads, inv_freq), {}


def _linear_glu_inputs(rows, cols, dtype, device, gen):
    # output [rows, cols] = act(x Wa^T + ba) * (x Wb^T + bb) from x [rows, K], weight [2 cols, K], K = cols / 4 (the
    # FFN-in: hidden -> 4 x hidden); weights at 1/sqrt(K) keep both halves of order 1
    k = max(cols // 4, 1)
    x = _randn((rows, k), dtype, device, gen)
    w = _randn((2 * cols, k), dtype, device, gen, scale=k**-0.5)
    b = _randn((2 * cols,), dtype, device, gen, scale=0.5)
    return (x, w, b, "gelu"), {}


def splade_vocab(cols: int) -> int:
    """The vocabulary width of a splade_pool test at hidden width `cols`: 3 x cols + 5, at most 2053 (no multiple of a
    power-of-two tile, a ragged last vocab tile; capped so that a wide hidden width keeps the interpreter quick)."""
    return min(3 * cols + 5, 2053)


def _splade_pool_inputs(rows, cols, dtype, device, gen):
    # packed segments (_packed; the filler tokens are NaN: never to be read) of hidden states x [rows, cols] of order
    # 1 (the MLM head's are LayerNormed), weight [V, cols] at 1/sqrt(cols) and a bias shifted down: logits ~ N(-0.5,
    # 1.25), about a third of them positive, so a one-token segment's output is mostly zeros and a long one's mostly not
    real, _, offsets = _packed(rows, 128, 4, device, gen)
    vocab = splade_vocab(cols)
    x = _randn((rows, cols), dtype, device, gen)
    x[real:] = float("nan")
    w = _randn((vocab, cols), dtype, device, gen, scale=cols**-0.5)
    b = _randn((vocab,), dtype, device, gen, scale=0.5, shift=-0.5)
    return (x, w, b, offsets), {}


M3_DROPPED_IDS = (0, 1, 2, 3, 250001)  # XLM-R's <s>, <pad>, </s>, <unk> (BGE-M3's CLS, PAD, EOS, UNK), one absent


def _m3_sparse_inputs(rows, cols, dtype, device, gen):
    # packed segments (_packed, one more empty segment among them; the filler tokens are NaN: never to be read) of
    # token ids from a small vocabulary (repeats within and across sequences), each sequence between CLS (0) and EOS
    # (2), a few UNK (3) and PAD (1), dropped with an id absent from the batch; about a quarter of the tokens copy an
    # earlier token of their sequence, row and id (ties of equal weights). Exact values: x in 1/16ths of [-4, 4], the
    # weight in 1/256ths at about 1/sqrt(cols), the bias in 1/4096ths: every product and partial sum is exact in fp32,
    # so a weight is the same whatever the summation order and the representatives are not a matter of rounding
    # (pre-activations ~ N(-0.5, 1.5): about a third of the weights are relu's 0)
    real, lengths, offsets = _packed(rows, 128, 4, "cpu", gen)
    at = int(torch.randint(0, offsets.numel(), (1,), generator=gen))
    offsets = torch.cat([offsets[:at + 1], offsets[at:]])
    vocab = 4 + max(3, real // 6)
    ids = torch.randint(4, vocab, (rows,), generator=gen, dtype=torch.int32)
    ids[torch.rand(rows, generator=gen) < 0.05] = 3
    ids[torch.rand(rows, generator=gen) < 0.02] = 1
    x = (torch.randn((rows, cols), generator=gen) * 24).round().clamp(-64, 64) / 16
    copy, pick = torch.rand(rows, generator=gen).tolist(), torch.rand(rows, generator=gen).tolist()
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for t in range(start + 1, end):
            if copy[t] < 0.25:
                source = start + int(pick[t] * (t - start))
                x[t], ids[t] = x[source], ids[source]
        if end - start > 1:
            ids[start], ids[end - 1] = 0, 2
    x[real:] = float("nan")
    weight = (torch.randn((cols,), generator=gen) * 256 * cols**-0.5).round().clamp(-255, 255) / 256
    bias = ((torch.randn((1,), generator=gen) * 0.25 - 0.5) * 4096).round() / 4096
    dropped = torch.tensor(M3_DROPPED_IDS, dtype=torch.int32)
    return (x.to(device, dtype), weight.to(device, dtype), bias.to(device), ids.to(device), offsets.to(device),
            dropped.to(device)), {}


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


def _fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_head(args, rows, cols, dtype):
    return (args[5], rows, cols), _fp32(dtype)


def _per_split(args, rows, cols, dtype):
    return (args[4], rows, cols), _fp32(dtype)


def _same_as_input(args, rows, cols, dtype):
    return (rows, cols), dtype


def _qkv_width(args, rows, cols, dtype):
    return (rows, args[0].shape[1] // 3), dtype


def _per_segment(args, rows, cols, dtype):
    return (args[1].numel() - 1, cols), _fp32(dtype)


def _per_segment_vocab(args, rows, cols, dtype):
    return (args[3].numel() - 1, args[1].shape[0]), _fp32(dtype)


def _per_token(args, rows, cols, dtype):
    return (rows,), _fp32(dtype)


def _like_first(x, *args, **kwargs) -> Tensor:
    return torch.empty_like(x)


def _with_sum_fake(x, *args):
    # add_layer_norm, add_rms_norm: (y, the pre-norm sum or an empty tensor), return_sum the schema's last argument
    return torch.empty_like(x), (torch.empty_like(x) if args[-1] else x.new_empty(0))


def _gemm_fake(x, weight, *args) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@dataclass(frozen=True)
class OpSpec:
    name: str
    reference: Callable[..., Tensor]  # its signature (less `out=`) is the op's
    doc: str
    fake: Callable[..., Tensor | tuple[Tensor, Tensor]]  # output(s) of the schema's arguments, for torch.compile
    make_inputs: Callable[..., tuple[tuple, dict]]  # (rows, cols, dtype, device, generator) -> (args, kwargs)
    rowwise: bool = True  # the first argument is [rows, cols] like the output (not so for a GEMM)
    race_cols: Callable[[int], int] = lambda hidden: hidden  # output width at a model's hidden size
    # (args, rows, cols, dtype) -> the output's (shape, dtype): [rows, cols] in the input dtype unless said
    output: Callable[..., tuple[tuple[int, ...], torch.dtype]] = _same_as_input
    # the fused backends that implement it: backend -> the module of kernels/<backend>/ whose function named after
    # the op is its launcher (an op absent here runs on the reference only)
    fused_in: Mapping[str, str] = field(kw_only=True, hash=False)
    differentiable: bool = False  # torch.library autograd (recomputed through the fp32 reference)

    def __post_init__(self) -> None:  # read-only: the op list is fixed once this module is imported
        object.__setattr__(self, "fused_in", types.MappingProxyType(dict(self.fused_in)))


def _triton_and_cuda(triton_module: str) -> dict[str, str]:
    # every CUDA launcher lives in kernels/cuda/launchers.py (its kernels are in csrc/)
    return {"triton": triton_module, "cuda": "launchers"}


def _triton_only(triton_module: str) -> dict[str, str]:
    return {"triton": triton_module}


# the CPU backend's ops all live in kernels/cpu/aten.py (ATen's CPU kernels, composed in fewer passes)
_CPU = {"cpu": "aten"}


def ops_of(backend: str) -> list[str]:
    """The ops a fused backend implements (the registry runs the rest on the reference when it is forced)."""
    return [op for op, spec in OP_SPECS.items() if backend in spec.fused_in]


def launcher_modules(backend: str) -> dict[str, str]:
    """{op: module name under kernels/<backend>/ holding its launcher, a function named after the op} for the ops
    `backend` implements."""
    return {op: spec.fused_in[backend] for op, spec in OP_SPECS.items() if backend in spec.fused_in}


_SPECS = (
    OpSpec("layer_norm", reference.layer_norm, "LayerNorm over the last dimension.", _like_first, _ln_inputs,
           fused_in=_triton_and_cuda("layer_norm")),
    OpSpec("layer_norm_gelu", reference.layer_norm_gelu,
           'GELU(LayerNorm(x)); exact erf GELU unless approximate="tanh".', _like_first, _ln_inputs,
           differentiable=True, fused_in=_triton_and_cuda("layer_norm_gelu")),
    OpSpec("bias_gelu", reference.bias_gelu, "GELU(x + bias), bias broadcast over rows.", _like_first,
           _bias_gelu_inputs, fused_in=_triton_and_cuda("bias_gelu")),
    OpSpec("bias_residual_gelu", reference.bias_residual_gelu, "GELU(x + bias + residual).", _like_first,
           _bias_residual_gelu_inputs, fused_in=_triton_and_cuda("bias_residual_gelu")),
    OpSpec("add_layer_norm", reference.add_layer_norm,
           "LayerNorm(x + bias + residual); with return_sum=True also the pre-norm sum.", _with_sum_fake,
           _add_ln_inputs, differentiable=True, fused_in=_triton_and_cuda("add_layer_norm")),
    # RMSNorm in transformers' Qwen2/Qwen3 order (decoder embedders). Not `rowwise` though row-wise: ROWWISE_OPS is
    # what the CUDA backend's row-wise tests and `bench kernels fused-ops` take, and neither has these yet (the Triton
    # tests of strided, 3-D and non-finite inputs name them beside ROWWISE_OPS)
    OpSpec("rms_norm", reference.rms_norm,
           "RMSNorm over the last dimension as transformers' Qwen3RMSNorm: weight * (x / sqrt(mean(x^2) + eps)), the "
           "normalized value rounded to x's dtype before the weight.", _like_first, _rms_inputs, rowwise=False,
           fused_in=_triton_only("rms_norm")),
    OpSpec("add_rms_norm", reference.add_rms_norm,
           "rms_norm(x + residual), the sum rounded to x's dtype first; with return_sum=True also that sum (a "
           "pre-norm decoder's residual stream).", _with_sum_fake, _add_rms_inputs, rowwise=False,
           fused_in=_triton_only("add_rms_norm")),
    OpSpec("embedding_layer_norm", reference.embedding_layer_norm,
           "LayerNorm(word[ids] + position[pos] + token_type[types]) for flat id vectors: [tokens] -> "
           "[tokens, hidden].",
           lambda ids, pos, types, word, *rest: word.new_empty((*ids.shape, word.shape[1])), _embedding_ln_inputs,
           fused_in=_triton_and_cuda("embedding_layer_norm")),
    OpSpec("linear_bias_gelu", reference.linear_bias_gelu,
           "GELU(x @ weight^T + bias), weight in nn.Linear's [out, in] layout: the FFN-in of an encoder layer.",
           _gemm_fake, _linear_gelu_inputs, rowwise=False, race_cols=lambda hidden: 4 * hidden,
           fused_in=_triton_and_cuda("linear_gelu") | _CPU),
    OpSpec("linear_add_layer_norm", reference.linear_add_layer_norm,
           "LayerNorm(x @ weight^T + bias + residual), weight in nn.Linear's [out, in] layout: the attention-out "
           "and FFN-out blocks of a post-LN encoder layer.", _gemm_fake, _linear_ln_inputs, rowwise=False,
           fused_in=_triton_and_cuda("linear_layer_norm") | _CPU),
    # mean pooling of a packed batch: [rows tokens, cols] -> [segments, cols] float32
    OpSpec("segment_mean", reference.segment_mean,
           "Mean of each segment of rows, x [T, H] and offsets cu_seqlens [B + 1] -> [B, H] float32 (empty "
           "segment: 0; rows past the last offset unread): the mean pooling of a packed batch.",
           lambda x, cu: x.new_empty((cu.shape[0] - 1, x.shape[1]), dtype=_fp32(x.dtype)), _segment_inputs,
           rowwise=False, output=_per_segment, fused_in=_triton_and_cuda("segment_mean")),
    # a layer's QKV projection + attention over each packed sequence: [rows tokens, cols] -> [rows, cols]
    OpSpec("qkv_attention", reference.qkv_attention,
           "A layer's attention block before its output projection: q, k, v = x @ weight^T + bias (weight [3H, H], "
           "query/key/value stacked), softmax(q k^T / sqrt(d)) v per head within each packed sequence of x [T, H] "
           "(offsets cu_seqlens [B + 1], each at most max_seqlen long) -> [T, H]; rows past the last offset are "
           "zeros.", _like_first, _qkv_attention_inputs, rowwise=False,
           fused_in=_triton_only("qkv_attention")),
    # attention with a relative position bias (MPNet) over each packed sequence: [rows, 3 x cols] -> [rows, cols]
    OpSpec("relative_attention", reference.relative_attention,
           "softmax(q k^T / sqrt(d) + bias[h, j - i]) v per head within each packed sequence of qkv [T, 3H] (query, "
           "key and value stacked as qkv.view(T, 3, num_heads, d); offsets cu_seqlens [B + 1], each at most "
           "max_seqlen long) -> [T, H], the relative position bias read from the table bias [num_heads, 2R - 1] "
           "(key - query distance r at column r + R - 1, max_seqlen <= R); rows past the last offset are zeros.",
           lambda qkv, cu, max_seqlen, num_heads, bias: qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3)),
           _relative_attention_inputs, rowwise=False, fused_in=_triton_only("relative_attention")),
    # DeBERTa's disentangled attention (content + c2p + p2c) over each packed sequence: [rows, 3 x cols] -> [rows, cols]
    OpSpec("disentangled_attention", reference.disentangled_attention,
           "softmax((q_i . k_j + q_i . Pk[r] + k_j . Pq[r]) * scale) v per head within each packed sequence of qkv "
           "[T, 3H] (query, key and value stacked as qkv.view(T, 3, num_heads, d); offsets cu_seqlens [B + 1], each "
           "at most max_seqlen long) -> [T, H]: DeBERTa's disentangled attention, r = rows[i - j + R - 1] the "
           "relative table's row for the query - key distance (rows [2R - 1], max_seqlen <= R), pos_key and "
           "pos_query [P, H] the table projected for the c2p and p2c terms (None: that term off); rows past the last "
           "offset are zeros.",
           lambda qkv, cu, max_seqlen, num_heads, pos_key, pos_query, rows, scale: qkv.new_empty(
               (qkv.shape[0], qkv.shape[1] // 3)),
           _disentangled_attention_inputs, rowwise=False, fused_in=_triton_only("disentangled_attention")),
    # attention with rotary position embeddings (GTE, ModernBERT's global and sliding-window layers; Qwen's causal
    # grouped-query layers with their per-head q/k norms)
    OpSpec("rotary_attention", reference.rotary_attention,
           "softmax(rot(q) rot(k)^T / sqrt(d)) v per head within each packed sequence of qkv [T, (H + 2 KV) d] "
           "(num_heads query heads, then num_kv_heads key and value heads (default num_heads), d even; offsets "
           "cu_seqlens [B + 1], each at most max_seqlen long) -> [T, H d], rot the rotary embedding at the token's "
           "position within its sequence (0-based) with the frequencies inv_freq [d / 2] (transformers' "
           "rotate_half); window > 0: keys at most that far from the query only; causal: keys at or before it "
           "only; q_norm, k_norm [d]: each head of q and k RMS-normed first; rows past the last offset are zeros.",
           lambda qkv, cu, max_seqlen, num_heads, inv_freq, window=0, num_kv_heads=None, causal=False, q_norm=None,
           k_norm=None, norm_eps=1e-6: qkv.new_empty((qkv.shape[0], qkv.shape[1] // (
               num_heads + 2 * (num_kv_heads or num_heads)) * num_heads)),
           _rotary_attention_inputs, rowwise=False, output=_qkv_width, fused_in=_triton_only("rotary_attention")),
    # a gated feed-forward's first GEMM with its gate in the epilogue (GTE's GeGLU, NomicBERT's SwiGLU)
    OpSpec("linear_glu", reference.linear_glu,
           "act(x @ Wa^T + ba) * (x @ Wb^T + bb) for weight [2I, H] = [Wa; Wb] in nn.Linear's layout (the activated "
           "rows first) and bias [2I] or None -> [T, I]; act gelu (exact) or silu.",
           lambda x, weight, bias, activation="gelu": x.new_empty((*x.shape[:-1], weight.shape[0] // 2)),
           _linear_glu_inputs, rowwise=False, race_cols=lambda hidden: 4 * hidden,
           fused_in=_triton_only("linear_glu")),
    # SPLADE pooling of a packed batch: the MLM head's vocab GEMM with a per-segment max in its epilogue
    OpSpec("splade_pool", reference.splade_pool,
           "SPLADE pooling: max over each packed sequence's rows of log1p(relu(x @ weight^T + bias)) for x [T, H] (the "
           "MLM head's transformed hidden states; offsets cu_seqlens [B + 1]), weight [V, H] in nn.Linear's layout "
           "(the tied word embeddings) and bias [V] or None -> [B, V] float32 (empty segment: 0; rows past the last "
           "offset unread); the [T, V] logits are never written.",
           lambda x, weight, bias, cu: x.new_empty((cu.shape[0] - 1, weight.shape[0]), dtype=_fp32(x.dtype)),
           _splade_pool_inputs, rowwise=False, output=_per_segment_vocab, fused_in=_triton_only("splade_pool")),
    # BGE-M3's sparse head over a packed batch: each token's weight where it is its (sequence, id)'s largest
    OpSpec("m3_sparse", reference.m3_sparse,
           "BGE-M3's sparse output per token of a packed batch: relu(x[t] . weight + bias) (fp32) where token t is its "
           "(sequence, id) group's representative (the largest weight, a NaN above every number, the lowest index "
           "among equals) and ids[t] is not in dropped, else 0, for x [T, H], weight [H] in x's dtype, bias [1] "
           "float32, ids [T] and dropped [K] int32, offsets cu_seqlens [B + 1] -> [T] float32: each sequence's "
           "nonzeros are FlagEmbedding's sparse dict; tokens outside the offsets give 0 (unread); no [B, V] buffer.",
           lambda x, weight, bias, ids, cu, dropped: x.new_empty((x.shape[0],), dtype=_fp32(x.dtype)),
           _m3_sparse_inputs, rowwise=False, output=_per_token, fused_in=_triton_only("m3_sparse")),
    # the few-token layer's pieces: attention + each head's share of the output projection -> [heads, rows, cols]
    # fp32; the FFN split over its intermediate width -> [splits, rows, cols] fp32; their LayerNorm over the sum
    OpSpec("attention_partials", reference.attention_partials,
           "qkv_attention's context times each head's slice of the output projection out_weight [H, H]: "
           "[num_heads, T, H] float32 partial sums (summed: ctx @ out_weight^T), for partial_add_layer_norm.",
           lambda x, w, b, cu, max_seqlen, num_heads, out_weight: x.new_empty((num_heads, *x.shape),
                                                                              dtype=torch.float32),
           _attention_partials_inputs, rowwise=False, output=_per_head,
           fused_in=_triton_only("qkv_attention")),
    OpSpec("ffn_partials", reference.ffn_partials,
           "GELU(x @ w1^T + b1) @ w2^T as `splits` float32 partial sums over chunks of the intermediate width: "
           "[splits, T, H], for partial_add_layer_norm.",
           lambda x, w1, b1, w2, splits, approximate: x.new_empty((splits, *x.shape), dtype=torch.float32),
           _ffn_partials_inputs, rowwise=False, output=_per_split,
           fused_in=_triton_only("ffn_partials")),
    OpSpec("partial_add_layer_norm", reference.partial_add_layer_norm,
           "LayerNorm(parts.sum(0) + bias + residual): parts [P, T, H] float32 -> [T, H] in residual's dtype.",
           lambda parts, bias, residual, *rest: torch.empty_like(residual), _partial_ln_inputs, rowwise=False,
           fused_in=_triton_only("add_layer_norm")),
)
OP_SPECS: dict[str, OpSpec] = {spec.name: spec for spec in _SPECS}
OPS: tuple[str, ...] = tuple(OP_SPECS)
ROWWISE_OPS = tuple(op for op, spec in OP_SPECS.items() if spec.rowwise)
REFERENCE_OPS: dict[str, Callable[..., Tensor]] = {op: spec.reference for op, spec in OP_SPECS.items()}
