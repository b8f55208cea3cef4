"""What several kernel test modules share: test bodies both fused backends run (the Triton and CUDA test modules call
them with their launchers), and a fake clock for kernels.timing."""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import timing
from fusedserve.kernels.testing import OP_SPECS, compare, float64_reference, ops_of


class FakeClock:
    """perf_counter for kernels.timing: time moves only when a timed function says so, so what a test times is the
    durations it declares, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance_us(self, us: float) -> None:
        self.now += us / 1e6


def dyadic(gen: torch.Generator, shape, step: float, span: float) -> torch.Tensor:
    """Random multiples of `step` in [-span, span] (float64): products and sums of a few of them are exact in
    float64 and in float32, so a library in float64 and an op in float32 see the very same inputs."""
    return torch.randint(-int(span / step), int(span / step) + 1, shape, generator=gen).double() * step


def odd_layouts(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GEMM inputs of x's [rows, cols] shape in the layouts a caller may pass: a slice of a wider buffer (rows
    cols + 104 apart, not contiguous; random values of x's dtype), x as [2, rows / 2, cols], and x with transposed
    strides."""
    rows, cols = x.shape
    wide = torch.randn(rows, cols + 104, generator=torch.Generator().manual_seed(12)).to(x.device, x.dtype)
    strided = wide[:, 8:8 + cols]
    assert not strided.is_contiguous()
    return strided, x.view(2, rows // 2, cols), x.t().contiguous().t()


@contextlib.contextmanager
def cache_directory(path: Path) -> Iterator[Path]:
    """The kernel layer's cache directory set to `path` inside (kernels.configure, as the model layer sets it), back to
    the unconfigured fallback on exit."""
    kernels.configure(cache_dir=str(path))
    try:
        yield path
    finally:
        kernels.configure(cache_dir=None)


def install_fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A FakeClock as kernels.timing's clock until the test ends."""
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def check_offsets_past_two_to_the_31(launchers, op: str) -> None:
    """2^31 + a few rows' worth of bf16 elements (4.3 GB): the kernel must address the tail correctly."""
    cols = 1024
    rows = 2**31 // cols + 3
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    if op == "bias_gelu":
        out = launchers[op](x, bias)
        tail_args = (x[-5:], bias)
    else:
        residual = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(cols, device="cuda", dtype=torch.bfloat16)
        out = launchers[op](x, residual, bias, w, b, 1e-5)
        tail_args = (x[-5:], residual[-5:], bias, w, b, 1e-5)
        del residual
    tail = out[-5:].clone()
    del out, x
    assert compare(tail, float64_reference(op, tail_args, {}), torch.bfloat16).ok


def opcheck_custom_ops(backend: str, device: str) -> None:
    """torch.library.opcheck (schema, fake tensors, AOT dispatch) on every fusedserve::<backend>_<op>."""
    gen = torch.Generator().manual_seed(5)
    for op in ops_of(backend):
        args, _ = OP_SPECS[op].make_inputs(6, 40, torch.float32, device, gen)
        if op in ("add_layer_norm", "add_rms_norm"):
            args = (*args, False)
        elif op in ("layer_norm_gelu", "bias_gelu", "bias_residual_gelu", "linear_bias_gelu", "ffn_partials"):
            args = (*args, "none")
        elif op == "rotary_attention":  # the schema takes every argument: a window that restricts something, causal
            args = (*args, 3, None, True, None, None, 1e-6)
        custom = getattr(torch.ops.fusedserve, f"{backend}_{op}").default
        torch.library.opcheck(custom, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---- each op's formula written out again in float64, independently of kernels/reference.py ------------------------
# The oracle the kernels are checked against is kernels.reference evaluated in float64; these check that oracle (and
# the reference at the serving dtypes) against the ops' definitions: plain mean/variance, erf, softmax and sums per
# segment, no torch.nn.functional and nothing shared with the reference's code. They round nothing: the roundings the
# reference makes in the input dtype (rms_norm's normalized value, add_rms_norm's sum) must stay within its tolerance.


def _f64(value):
    return value.detach().to("cpu", torch.float64) if torch.is_tensor(value) and value.is_floating_point() else (
        value.detach().cpu() if torch.is_tensor(value) else value)


def _layer_norm64(h, weight, bias, eps):
    mean = h.sum(-1, keepdim=True) / h.shape[-1]
    var = ((h - mean) ** 2).sum(-1, keepdim=True) / h.shape[-1]  # biased, as LayerNorm's
    return (h - mean) / torch.sqrt(var + eps) * weight + bias


def _rms_norm64(h, weight, eps):
    # h / sqrt(mean(h^2) + eps) * weight, no intermediate rounding
    return h / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps) * weight


def _gelu64(h, approximate="none"):
    if approximate == "none":  # x * Phi(x)
        return h * 0.5 * (1.0 + torch.special.erf(h / 2**0.5))
    assert approximate == "tanh"
    return 0.5 * h * (1.0 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))


def _attention64(x, weight, bias, cu_seqlens, max_seqlen, num_heads):
    tokens, hidden = x.shape
    d = hidden // num_heads
    q, k, v = (x @ weight.T + bias).split(hidden, dim=1)
    ctx = torch.zeros_like(x)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        assert end - start <= max_seqlen
        for h in range(num_heads if end > start else 0):
            cols = slice(h * d, (h + 1) * d)
            scores = q[start:end, cols] @ k[start:end, cols].T / d**0.5
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            ctx[start:end, cols] = (weights / weights.sum(dim=1, keepdim=True)) @ v[start:end, cols]
    return ctx


def _relative_attention64(qkv, cu_seqlens, max_seqlen, num_heads, bias):
    # per sequence and head: softmax(q k^T / sqrt(d) + B) v with B[i, j] = bias[h, (j - i) + R - 1] written out
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    d, reach = hidden // num_heads, (bias.shape[1] + 1) // 2
    q, k, v = qkv.split(hidden, dim=1)
    ctx = torch.zeros((tokens, hidden), dtype=qkv.dtype)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        assert end - start <= max_seqlen <= reach
        column = torch.tensor([[j - i + reach - 1 for j in range(end - start)] for i in range(end - start)],
                              dtype=torch.long)
        for h in range(num_heads if end > start else 0):
            cols = slice(h * d, (h + 1) * d)
            scores = q[start:end, cols] @ k[start:end, cols].T / d**0.5 + bias[h][column]
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            ctx[start:end, cols] = (weights / weights.sum(dim=1, keepdim=True)) @ v[start:end, cols]
    return ctx


def _disentangled_attention64(qkv, cu_seqlens, max_seqlen, num_heads, pos_key, pos_query, rows, scale):
    # per sequence and head: softmax(S * scale) v with S[i, j] = q_i . k_j + q_i . Pk[r] + k_j . Pq[r], r = R[i, j] =
    # rows[(i - j) + R - 1]; q_i . Pk[r] read as entry (i, r) of q Pk^T, k_j . Pq[r] as entry (j, r) of k Pq^T (a term
    # whose table is None: left out)
    hidden = qkv.shape[1] // 3
    d, reach = hidden // num_heads, (rows.shape[0] + 1) // 2
    q, k, v = qkv.split(hidden, dim=1)
    ctx = torch.zeros((qkv.shape[0], hidden), dtype=qkv.dtype)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        n = end - start
        assert n <= max_seqlen <= reach
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        row = rows.long()[i - j + reach - 1]  # [query, key]
        for h in range(num_heads if n else 0):
            cols = slice(h * d, (h + 1) * d)
            qh, kh = q[start:end, cols], k[start:end, cols]
            scores = qh @ kh.T
            if pos_key is not None:
                scores = scores + (qh @ pos_key[:, cols].T)[i.expand(n, n), row]
            if pos_query is not None:
                scores = scores + (kh @ pos_query[:, cols].T)[j.expand(n, n), row]
            scores = scores * scale
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            ctx[start:end, cols] = (weights / weights.sum(dim=1, keepdim=True)) @ v[start:end, cols]
    return ctx


def _rotary_attention64(qkv, cu_seqlens, max_seqlen, num_heads, inv_freq, window=0, num_kv_heads=None, causal=False,
                        q_norm=None, k_norm=None, norm_eps=1e-6):
    # per sequence and query head: each head of q and k RMS-normed with its weight (when given), each pair of
    # dimensions (i, i + d/2) turned by the angle t * inv_freq[i] at the token's position t in its sequence, written
    # out as a plane rotation; query head h attends through key/value head h // (heads / kv_heads), softmax(q k^T /
    # sqrt(d)) v over the keys within `window` of the query (all of the sequence's for window 0), none after it when
    # causal
    kv_heads = num_kv_heads or num_heads
    d = qkv.shape[1] // (num_heads + 2 * kv_heads)
    half, group = d // 2, num_heads // kv_heads
    q, k, v = qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=1)
    ctx = torch.zeros((qkv.shape[0], num_heads * d), dtype=qkv.dtype)

    def prepare(x, weight, cos, sin):
        if weight is not None:
            x = x / torch.sqrt((x * x).mean(dim=1, keepdim=True) + norm_eps) * weight
        return torch.cat([x[:, :half] * cos - x[:, half:] * sin, x[:, half:] * cos + x[:, :half] * sin], dim=1)

    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        assert end - start <= max_seqlen
        angle = torch.arange(end - start, dtype=qkv.dtype)[:, None] * inv_freq[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        positions = torch.arange(end - start)
        distance = positions[None, :] - positions[:, None]  # [query, key]: key - query
        seen = (distance.abs() <= window) | (window == 0)
        if causal:
            seen = seen & (distance <= 0)
        for h in range(num_heads if end > start else 0):
            cols, kv = slice(h * d, (h + 1) * d), slice((h // group) * d, (h // group + 1) * d)
            scores = prepare(q[start:end, cols], q_norm, cos, sin) @ prepare(k[start:end, kv], k_norm, cos, sin).T
            scores = (scores / d**0.5).masked_fill(~seen, float("-inf"))
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            ctx[start:end, cols] = (weights / weights.sum(dim=1, keepdim=True)) @ v[start:end, kv]
    return ctx


def _segment_mean64(x, cu_seqlens):
    offsets = cu_seqlens.tolist()
    rows = [x[start:end].sum(0) / (end - start) if end > start else torch.zeros(x.shape[1], dtype=x.dtype)
            for start, end in zip(offsets[:-1], offsets[1:])]
    return torch.stack(rows) if rows else x.new_zeros((0, x.shape[1]))


def _attention_partials64(x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight):
    ctx = _attention64(x, weight, bias, cu_seqlens, max_seqlen, num_heads)
    d = x.shape[1] // num_heads
    return torch.stack([ctx[:, h * d:(h + 1) * d] @ out_weight[:, h * d:(h + 1) * d].T for h in range(num_heads)])


def _ffn_partials64(x, w1, b1, w2, splits, approximate="none"):
    inner = _gelu64(x @ w1.T + b1, approximate)
    chunk = inner.shape[1] // splits
    return torch.stack([inner[:, s * chunk:(s + 1) * chunk] @ w2[:, s * chunk:(s + 1) * chunk].T for s in range(splits)])


def _linear_glu64(x, weight, bias, activation="gelu"):
    # weight = [Wa; Wb]: the first half of its rows activated, times the second half's; silu(a) = a / (1 + e^-a)
    h = x @ weight.T + (bias if bias is not None else 0.0)
    a, b = h[..., :weight.shape[0] // 2], h[..., weight.shape[0] // 2:]
    assert activation in ("gelu", "silu")
    return (_gelu64(a) if activation == "gelu" else a / (1.0 + torch.exp(-a))) * b


def _splade_pool64(x, weight, bias, cu_seqlens):
    # per sequence: log(1 + max(logit, 0)) of each of its rows, the max over them; no rows: zeros
    offsets = cu_seqlens.tolist()
    rows = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        logits = x[start:end] @ weight.T + (bias if bias is not None else 0.0)
        rows.append(torch.log(1.0 + logits.clamp(min=0.0)).max(dim=0).values if end > start
                    else torch.zeros(weight.shape[0], dtype=x.dtype))
    return torch.stack(rows) if rows else x.new_zeros((0, weight.shape[0]))


def _m3_sparse64(x, weight, bias, ids, cu_seqlens, dropped):
    # FlagEmbedding's per-sentence dict, kept as the token holding each entry: walk each sequence's tokens in order,
    # skip the dropped ids, and let a token take its id's entry from the holder when its weight max(x . weight + b, 0)
    # is larger (a NaN larger than any number, and than nothing it meets later); the holders keep their weights
    weights = (x @ weight + bias).clamp(min=0.0)
    out = torch.zeros(x.shape[0], dtype=x.dtype)
    offsets, skip = cu_seqlens.tolist(), set(dropped.tolist())
    for start, end in zip(offsets[:-1], offsets[1:]):
        holder: dict[int, int] = {}
        for t in range(start, end):
            token, w = int(ids[t]), float(weights[t])
            if token in skip:
                continue
            if token not in holder:
                holder[token] = t
                continue
            held = float(weights[holder[token]])
            if held == held and (w != w or w > held):
                holder[token] = t
        for t in holder.values():
            out[t] = weights[t]
    return out


def _add_layer_norm64(x, residual, bias, weight, ln_bias, eps=1e-12, *, return_sum=False):
    s = x + residual + (bias if bias is not None else 0.0)
    y = _layer_norm64(s, weight, ln_bias, eps)
    return (y, s) if return_sum else y


def _add_rms_norm64(x, residual, weight, eps=1e-6, *, return_sum=False):
    s = x + residual
    y = _rms_norm64(s, weight, eps)
    return (y, s) if return_sum else y


FORMULAS = {
    "layer_norm": lambda x, w, b, eps=1e-12: _layer_norm64(x, w, b, eps),
    "layer_norm_gelu": lambda x, w, b, eps=1e-12, approximate="none": _gelu64(_layer_norm64(x, w, b, eps), approximate),
    "bias_gelu": lambda x, bias, approximate="none": _gelu64(x + bias, approximate),
    "bias_residual_gelu": lambda x, bias, residual, approximate="none": _gelu64(x + bias + residual, approximate),
    "add_layer_norm": _add_layer_norm64,
    "rms_norm": lambda x, w, eps=1e-6: _rms_norm64(x, w, eps),
    "add_rms_norm": _add_rms_norm64,
    "embedding_layer_norm": lambda ids, pos, types, word, position, token_type, w, b, eps=1e-12: _layer_norm64(
        word[ids] + position[pos] + token_type[types], w, b, eps),
    "linear_bias_gelu": lambda x, w, b, approximate="none": _gelu64(x @ w.T + b, approximate),
    "linear_add_layer_norm": lambda x, w, bias, residual, g, b, eps=1e-12: _layer_norm64(
        x @ w.T + bias + residual, g, b, eps),
    "linear_glu": _linear_glu64,
    "splade_pool": _splade_pool64,
    "m3_sparse": _m3_sparse64,
    "segment_mean": _segment_mean64,
    "qkv_attention": _attention64,
    "relative_attention": _relative_attention64,
    "disentangled_attention": _disentangled_attention64,
    "rotary_attention": _rotary_attention64,
    "attention_partials": _attention_partials64,
    "ffn_partials": _ffn_partials64,
    "partial_add_layer_norm": lambda parts, bias, residual, w, b, eps=1e-12: _layer_norm64(
        parts.sum(0) + (bias if bias is not None else 0.0) + residual, w, b, eps),
}


def formula_float64(op: str, args: tuple, kwargs: dict):
    """The op's definition evaluated in float64 on the CPU, on exactly the (already rounded) inputs."""
    return FORMULAS[op](*map(_f64, args), **kwargs)


def packed_qkv(lengths, hidden: int, gen: torch.Generator, first: int = 0,
               filler: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed attention op's float32 qkv [first + sum(lengths) + filler, 3 * hidden] of order 1, its rows before
    `first` and its filler rows NaN (never to be read), and the int32 offsets of `lengths` from `first`."""
    t = first + sum(lengths) + filler
    qkv = torch.randn(t, 3 * hidden, generator=gen)
    qkv[:first] = float("nan")
    qkv[t - filler:] = float("nan")
    return qkv, torch.tensor(list(itertools.accumulate(lengths, initial=first)), dtype=torch.int32)
