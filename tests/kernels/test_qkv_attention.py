"""qkv_attention (a layer's QKV projection + attention per packed sequence) and the few-token layer's ops
(attention_partials, ffn_partials, partial_add_layer_norm) beyond the generic sweeps: sequences longer than a block
and a max_seqlen bound below or far above the real lengths, filler rows and empty sequences, heads too wide for the
kernel, clear errors, a whole layer against the unfused float64 one, the model's shapes on the GPU and CUDA-graph
replays. Triton runs on the interpreter here (and on the GPU with -m gpu); the CUDA backend implements none of them."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedserve.kernels.testing import compare, float64_reference
from fusedserve.kernels.triton import LAUNCHERS

NAN = float("nan")


def _triton():
    return LAUNCHERS["qkv_attention"]


def _inputs(lengths, hidden, heads, dtype, device, filler=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths) + filler
    x = torch.randn(t, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(3 * hidden, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    b = (torch.randn(3 * hidden, generator=gen) * 0.5).to(device, dtype)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return x, w, b, cu


def _check(out, x, w, b, cu, heads, dtype):
    # the float64 reference with a tight bound (the reference needs every sequence within max_seqlen)
    longest = int((cu[1:] - cu[:-1]).max())
    report = compare(out, float64_reference("qkv_attention", (x, w, b, cu, longest, heads), {}), dtype)
    assert report.ok, report


@pytest.mark.parametrize("bound", [16, 256])
def test_sequences_longer_than_a_block_with_a_short_or_loose_bound(device, bound):
    # 16 -> one 16-row block per step: the 70- and 130-token sequences take several query programs' turns and several
    # key blocks (online softmax); 256 -> 64-row blocks and a grid of mostly idle query programs
    lengths = [1, 70, 130, 5, 16]
    x, w, b, cu = _inputs(lengths, 96, 3, torch.float32, device, filler=9, seed=bound)
    out = torch.full_like(x, NAN)
    _triton()(x, w, b, cu, bound, 3, out=out)
    _check(out, x, w, b, cu, 3, torch.float32)


def test_filler_rows_are_zeros_and_empty_sequences_cost_nothing(device):
    x, w, b, _ = _inputs([5, 3], 64, 4, torch.float16, device, filler=21, seed=1)
    cu = torch.tensor([0, 5, 5, 8, 8, 8], dtype=torch.int32, device=device)  # empty sequences between and after
    out = _triton()(x, w, b, cu, 16, 4)
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))
    _check(out, x, w, b, cu, 4, torch.float16)


def test_heads_too_wide_for_the_kernel_run_the_torch_path(device):
    x, w, b, cu = _inputs([3, 4], 160, 1, torch.float32, device, filler=2, seed=2)  # one head of 160 > 128
    out = torch.full_like(x, NAN)
    assert _triton()(x, w, b, cu, 16, 1, out=out).data_ptr() == out.data_ptr()
    _check(out, x, w, b, cu, 1, torch.float32)


def test_bad_arguments_raise_clear_errors(device):
    launch = _triton()
    x, w, b, cu = _inputs([3, 4], 64, 4, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        launch(x, w[:-1], b, cu, 16, 4)
    with pytest.raises(ValueError, match="5 heads do not split 64"):
        launch(x, w, b, cu, 16, 5)
    with pytest.raises(TypeError, match="must share"):
        launch(x, w.half(), b, cu, 16, 4)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        launch(x, w, b, cu.float(), 16, 4)
    with pytest.raises(ValueError, match="out must be"):
        launch(x, w, b, cu, 16, 4, out=torch.empty(3, 64, device=device))


# ---- the GPU: the model's shapes, graphs -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden,heads,lengths", [
    (384, 12, [16]),                                          # MiniLM, a single short request
    (384, 12, [128] * 32),                                    # MiniLM b32 s128 fixed
    (768, 12, [7, 120, 33, 64, 1, 128, 90, 3]),               # BERT-base, mixed lengths
    (768, 12, [256, 300]),                                    # longer than any block: several query/key blocks
])
def test_model_shapes_on_the_gpu(dtype, hidden, heads, lengths):
    x, w, b, cu = _inputs(lengths, hidden, heads, dtype, "cuda", filler=13, seed=len(lengths))
    out = torch.full_like(x, NAN)
    _triton()(x, w, b, cu, max(lengths), heads, out=out)
    assert torch.equal(out[sum(lengths):], torch.zeros_like(out[sum(lengths):]))
    _check(out, x, w, b, cu, heads, dtype)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_inputs():
    launch = _triton()
    x, w, b, cu = _inputs([9, 30, 2], 384, 12, torch.float16, "cuda", filler=7, seed=4)
    out = torch.empty_like(x)
    launch(x, w, b, cu, 64, 12, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(x, w, b, cu, 64, 12, out=out)
    x2, _, _, _ = _inputs([9, 30, 2], 384, 12, torch.float16, "cuda", filler=7, seed=5)
    x.copy_(x2)
    cu.copy_(torch.tensor([0, 20, 41, 41], dtype=torch.int32))  # new lengths, same bound
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, w, b, cu, 12, torch.float16)


# ---- the few-token layer's pieces: attention_partials, ffn_partials, partial_add_layer_norm ------------------------


def _few_token_layer(x, w, b, cu, heads, wo, bo, w1, b1, w2, b2, ln, splits):
    """One encoder layer through the three few-token Triton ops (as model.bert.Layer._few_token_layer)."""
    g1, be1, g2, be2 = ln
    y = LAUNCHERS["partial_add_layer_norm"](LAUNCHERS["attention_partials"](x, w, b, cu, 64, heads, wo), bo, x, g1,
                                            be1, 1e-12)
    return LAUNCHERS["partial_add_layer_norm"](LAUNCHERS["ffn_partials"](y, w1, b1, w2, splits), b2, y, g2, be2, 1e-12)


def _layer_weights(hidden, inner, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device, dtype)

    return (r(hidden, hidden, scale=hidden**-0.5), r(hidden, scale=0.5), r(inner, hidden, scale=hidden**-0.5),
            r(inner, scale=0.5), r(hidden, inner, scale=inner**-0.5), r(hidden, scale=0.5),
            (r(hidden, scale=0.2, shift=1.0), r(hidden, scale=0.2), r(hidden, scale=0.2, shift=1.0), r(hidden, scale=0.2)))


def _reference_layer(x, w, b, cu, heads, wo, bo, w1, b1, w2, b2, ln):
    """The unfused float64 layer: attention, output projection, add + LayerNorm, FFN, add + LayerNorm."""
    from fusedserve.kernels import reference

    g1, be1, g2, be2 = (t.double().cpu() for t in ln)
    x, w, b, cu, wo, bo, w1, b1, w2, b2 = (t.double().cpu() if t.is_floating_point() else t.cpu()
                                           for t in (x, w, b, cu, wo, bo, w1, b1, w2, b2))
    longest = int((cu[1:] - cu[:-1]).max())
    ctx = reference.qkv_attention(x, w, b, cu, longest, heads)
    y = reference.add_layer_norm(ctx @ wo.T, x, bo, g1, be1, 1e-12)
    return reference.add_layer_norm(reference.linear_bias_gelu(y, w1, b1) @ w2.T, y, b2, g2, be2, 1e-12)


def test_the_few_token_layer_equals_the_unfused_layer(device):
    x, w, b, cu = _inputs([5, 11], 64, 4, torch.float32, device, filler=6, seed=7)
    wo, bo, w1, b1, w2, b2, ln = _layer_weights(64, 256, torch.float32, device, seed=8)
    out = _few_token_layer(x, w, b, cu, 4, wo, bo, w1, b1, w2, b2, ln, splits=4)
    ref = _reference_layer(x, w, b, cu, 4, wo, bo, w1, b1, w2, b2, ln)
    report = compare(out[:16], ref[:16], torch.float32)  # filler rows: LayerNorm of the bias and residual alone
    assert report.ok, report
    again = _few_token_layer(x, w, b, cu, 4, wo, bo, w1, b1, w2, b2, ln, splits=4)
    assert torch.equal(out, again)  # partial sums added in a fixed order: deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden,heads,inner,lengths", [
    (384, 12, 1536, [16]),           # MiniLM, a single short request
    (384, 12, 1536, [9, 30, 2, 17]),  # MiniLM, a few requests in a 64-token bucket
    (768, 12, 3072, [20, 23]),       # BERT-base
])
def test_few_token_ops_at_model_shapes_on_the_gpu(dtype, hidden, heads, inner, lengths):
    from fusedserve.model.bert import ffn_splits

    x, w, b, cu = _inputs(lengths, hidden, heads, dtype, "cuda", filler=64 - sum(lengths), seed=len(lengths))
    wo, bo, w1, b1, w2, b2, ln = _layer_weights(hidden, inner, dtype, "cuda", seed=hidden)
    longest = max(lengths)
    parts = torch.full((heads, 64, hidden), NAN, device="cuda")
    LAUNCHERS["attention_partials"](x, w, b, cu, longest, heads, wo, out=parts)
    ref = float64_reference("attention_partials", (x, w, b, cu, longest, heads, wo), {})
    assert compare(parts, ref, dtype).ok
    splits = ffn_splits(inner)
    fparts = torch.full((splits, 64, hidden), NAN, device="cuda")
    LAUNCHERS["ffn_partials"](x, w1, b1, w2, splits, out=fparts)
    assert compare(fparts, float64_reference("ffn_partials", (x, w1, b1, w2, splits), {}), dtype).ok
    out = _few_token_layer(x, w, b, cu, heads, wo, bo, w1, b1, w2, b2, ln, splits)
    report = compare(out[: sum(lengths)], _reference_layer(x, w, b, cu, heads, wo, bo, w1, b1, w2, b2, ln)[
        : sum(lengths)], dtype)
    assert report.ok, report


@pytest.mark.gpu
def test_the_few_token_layer_replays_in_a_cuda_graph():
    x, w, b, cu = _inputs([9, 30, 2], 384, 12, torch.float16, "cuda", filler=23, seed=4)
    wo, bo, w1, b1, w2, b2, ln = _layer_weights(384, 1536, torch.float16, "cuda", seed=5)
    _few_token_layer(x, w, b, cu, 12, wo, bo, w1, b1, w2, b2, ln, 24)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _few_token_layer(x, w, b, cu, 12, wo, bo, w1, b1, w2, b2, ln, 24)
    x.copy_(_inputs([9, 30, 2], 384, 12, torch.float16, "cuda", filler=23, seed=6)[0])
    cu.copy_(torch.tensor([0, 20, 41, 41], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference_layer(x, w, b, cu, 12, wo, bo, w1, b1, w2, b2, ln)
    assert compare(out[:41], ref[:41], torch.float16).ok
