"""rotary_attention (attention over packed sequences with q and k rotated by their position, GTE's and ModernBERT's)
beyond the generic sweeps: against the op's formula written out in float64 (tests/kernels/_shared.py: a loop over
sequences and heads, each pair of dimensions turned by an explicit plane rotation), on single tokens, long sequences
over several query and key blocks, empty filler sequences and filler rows, head widths 8 to 64, with and without a
sliding window (one reaching past the sequence too); key blocks outside a window never visited; NaN; heads the kernel
leaves to the torch path; clear errors; the rotation's convention against transformers' own GTE attention, and the
window's against transformers' ModernBERT local attention. Triton runs on the interpreter here (and on the GPU with
-m gpu); the CUDA backend does not implement it."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare
from fusedserve.kernels.triton import LAUNCHERS
from fusedserve.kernels.triton.rotary_attention import launch_shape, rotate_shape, windowed
from tests.conftest import INTERPRETER
from tests.kernels._shared import dyadic, formula_float64, packed_qkv

NAN = float("nan")
OP = "rotary_attention"
# the interpreter's bf16 runs the fp32 path (see test_triton_ops.FP32_ON_THE_INTERPRETER); the GPU runs all three
DTYPES = (torch.float32, torch.float16) if INTERPRETER else (torch.float32, torch.float16, torch.bfloat16)


def _launch():
    return LAUNCHERS[OP]


def inverse_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """transformers' default rotary frequencies, float32 as models keep them."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _inputs(lengths, hidden, heads, dtype, device, filler=0, seed=0, first=0, theta=10000.0):
    """qkv [first + sum(lengths) + filler, 3 * hidden] of order 1 (rows before `first` and the filler rows are NaN:
    never to be read), offsets from `first`, and the frequencies of `theta` at the head width."""
    gen = torch.Generator().manual_seed(seed)
    qkv, cu = packed_qkv(lengths, hidden, gen, first, filler)
    return qkv.to(device, dtype), cu.to(device), inverse_frequencies(hidden // heads, theta).to(device)


def _expected(qkv, cu, max_seqlen, heads, inv_freq, window, first=0):
    begin, end = first, int(cu[-1])
    return formula_float64(OP, (qkv[begin:end], cu - begin, max_seqlen, heads, inv_freq), {"window": window})


def _check(out, qkv, cu, max_seqlen, heads, inv_freq, window, dtype, first=0):
    """Every row against the formula in float64: the sequences' rows within the dtype's tolerance (relative L2 and
    elementwise, kernels.testing.TOLERANCES), every other row exactly zero."""
    begin, end = first, int(cu[-1])
    report = compare(out[begin:end], _expected(qkv, cu, max_seqlen, heads, inv_freq, window, first), dtype)
    assert report.ok, report
    outside = torch.cat([out[:begin], out[end:]])
    assert torch.equal(outside, torch.zeros_like(outside)), "rows outside the sequences must be zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,hidden,heads,window", [
    ([1], 8, 1, 0),                                  # a single token of a head of 8: its own value
    ([7], 64, 2, 0),                                 # heads of 32
    ([300], 64, 1, 0),                               # several query blocks, 64-key steps, a partial last key block
    ([5, 0, 130, 1, 64, 33, 0, 0], 64, 2, 0),        # a mix, empty sequences between and after
    ([40, 17, 0], 32, 4, 0),                         # heads of 8, square blocks of the bound (64)
    ([300, 7], 64, 1, 4),                            # a small window over a long sequence: most key blocks skipped
    ([7, 150, 1, 0], 64, 2, 1),                      # the least window: a query and its two neighbours
    ([200, 33, 0], 128, 2, 64),                      # ModernBERT's window at heads of 64
])
def test_matches_the_formula(device, dtype, lengths, hidden, heads, window):
    qkv, cu, inv_freq = _inputs(lengths, hidden, heads, dtype, device, filler=11, seed=len(lengths) + hidden + window)
    max_seqlen = max(lengths)
    out = torch.full((qkv.shape[0], hidden), NAN, dtype=dtype, device=device)
    assert _launch()(qkv, cu, max_seqlen, heads, inv_freq, window, out=out).data_ptr() == out.data_ptr()
    _check(out, qkv, cu, max_seqlen, heads, inv_freq, window, dtype)


@pytest.mark.parametrize("window", [0, 40, 600])
def test_a_loose_bound_and_a_window_past_the_sequences(device, window):
    """max_seqlen far above the real lengths (a graph bucket's), rows before the first offset (zeros like the filler
    past the last); a window longer than every sequence (40, under the bound: the windowed kernel, each query block's
    keys clamped to its sequence) or than the bound (600: the kernel without the window) is no window at all."""
    qkv, cu, inv_freq = _inputs([3, 20, 0, 11], 64, 2, torch.float16, device, filler=5, seed=3 + window, first=4)
    assert windowed(512, window) == (window == 40)
    out = torch.full((qkv.shape[0], 64), NAN, dtype=torch.float16, device=device)
    _launch()(qkv, cu, 512, 2, inv_freq, window, out=out)
    _check(out, qkv, cu, 512, 2, inv_freq, window, torch.float16, first=4)
    _check(out, qkv, cu, 512, 2, inv_freq, 0, torch.float16, first=4)  # the same as no window


def test_gte_base_frequencies_at_long_positions(device):
    """GTE's theta (160000) and positions up to 600: the fp32 angles and their cos and sin hold the float32 tolerance
    against the float64 rotation (the table of frequencies spans 1 to about 1/160000 radians a position)."""
    qkv, cu, inv_freq = _inputs([600, 9], 64, 1, torch.float32, device, filler=2, seed=21, theta=160000.0)
    out = _launch()(qkv, cu, 600, 1, inv_freq)
    _check(out, qkv, cu, 600, 1, inv_freq, 0, torch.float32)


def test_key_blocks_outside_the_window_are_never_visited(device):
    """A NaN value at key j: the formula's probabilities are exactly 0 outside |i - j| <= window, but 0 x NaN is NaN,
    so a query row whose program visited j's key block (masked or not) would come out NaN in j's column. The rows
    whose query block lies farther than one query block and one key block from j come out finite and equal to the
    formula with that value replaced (any value: it is out of their reach): their programs never loaded it."""
    window, j = 4, 150
    qkv, cu, inv_freq = _inputs([300], 32, 1, torch.float32, device, filler=1, seed=8)
    shape = launch_shape(300, 32, True, window)
    poisoned = qkv.clone()
    poisoned[j, 2 * 32 + 5] = NAN
    out = _launch()(poisoned, cu, 300, 1, inv_freq, window)
    rows = torch.arange(300)
    assert torch.isnan(out[:300, 5][(rows - j).abs() <= window]).all()  # its window: NaN, as in the formula
    far = (rows - j).abs() > shape["BLOCK_M"] + shape["BLOCK_N"] + window
    assert far.sum() > 150 and not torch.isnan(out[:300][far]).any()
    report = compare(out[:300][far], _expected(qkv, cu, 300, 1, inv_freq, window)[far], torch.float32)
    assert report.ok, report


def test_nan_propagates_within_its_sequence_head_and_reach_only(device):
    """Without a window a NaN value element reaches exactly its column of its sequence (as in the formula); with one,
    a NaN key reaches every column of its head in the query rows within the window of it and no others, and a NaN
    query only its own row. Never another sequence, head or the filler rows; the NaN rows outside the sequences are
    never read. A result left NaN where the formula has a number fails the comparison."""
    qkv, cu, inv_freq = _inputs([6, 9, 4], 32, 2, torch.float32, device, filler=4, seed=5)
    qkv[8, 2 * 32 + 16 + 3] = NAN  # sequence 1, head 1, value column 3
    out = _launch()(qkv, cu, 9, 2, inv_freq)
    _check(out, qkv, cu, 9, 2, inv_freq, 0, torch.float32)
    assert torch.isnan(out[6:15, 16 + 3]).all() and torch.isnan(out).sum() == 9
    out[0, 0] = NAN
    assert not compare(out[:19], _expected(qkv, cu, 9, 2, inv_freq, 0), torch.float32).ok

    qkv, cu, inv_freq = _inputs([40, 9], 32, 2, torch.float32, device, filler=4, seed=6)
    qkv[20, 32 + 16 + 3] = NAN  # sequence 0, token 20, head 1, key column 3
    qkv[30, 2] = NAN  # sequence 0, token 30, head 0, query column 2
    out = _launch()(qkv, cu, 40, 2, inv_freq, 2)
    _check(out, qkv, cu, 40, 2, inv_freq, 2, torch.float32)
    assert torch.isnan(out[18:23, 16:]).all() and torch.isnan(out[30, :16]).all()
    assert torch.isnan(out).sum() == 5 * 16 + 16


def test_heads_too_wide_for_the_kernel_run_the_torch_path(device):
    qkv, cu, inv_freq = _inputs([3, 4], 160, 1, torch.float32, device, filler=2, seed=2)  # one head of 160 > 128
    out = torch.full((qkv.shape[0], 160), NAN, device=device)
    assert _launch()(qkv, cu, 4, 1, inv_freq, 2, out=out).data_ptr() == out.data_ptr()
    _check(out, qkv, cu, 4, 1, inv_freq, 2, torch.float32)


def test_bad_arguments_raise_clear_errors(device):
    launch = _launch()
    qkv, cu, inv_freq = _inputs([3, 4], 64, 4, torch.float32, device)
    with pytest.raises(ValueError, match="must be \\[T, 3H\\]"):
        launch(qkv[:, 1:], cu, 4, 4, inv_freq)
    with pytest.raises(ValueError, match="5 heads do not split 64"):
        launch(qkv, cu, 4, 5, inv_freq)
    with pytest.raises(ValueError, match="heads of 21 columns \\(odd\\)"):
        launch(torch.zeros(7, 3 * 63, device=device), cu, 4, 3, inv_freq)
    with pytest.raises(ValueError, match="inv_freq must be \\[head_dim / 2\\] = \\[8\\]"):
        launch(qkv, cu, 4, 4, inv_freq[:7])
    with pytest.raises(ValueError, match="inv_freq must be"):
        launch(qkv, cu, 4, 4, inv_freq[None])
    with pytest.raises(ValueError, match="window must be 0"):
        launch(qkv, cu, 4, 4, inv_freq, -1)
    with pytest.raises(TypeError, match="qkv must be one of"):
        launch(qkv.double(), cu, 4, 4, inv_freq)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        launch(qkv, cu.float(), 4, 4, inv_freq)
    with pytest.raises(ValueError, match="out must be"):
        launch(qkv, cu, 4, 4, inv_freq, out=torch.empty(7, 192, device=device))


def test_launch_shapes_hold_the_kernels_limits():
    """relative_attention's rule (square blocks of the bound for short sequences, 64 keys a step past 64 tokens, 128
    queries from 256 on, 32 x 32 at most for fp32), at most 64 queries a program under a window that restricts
    anything; every block at least tl.dot's 16. The rotation pass: every head and half a head a row, about 4096
    elements a program."""
    assert launch_shape(16, 64) == {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 64, "num_warps": 4, "num_stages": 2}
    assert launch_shape(512, 64)["BLOCK_M"] == 128 and launch_shape(512, 64, window=64)["BLOCK_M"] == 64
    assert launch_shape(512, 64, window=600)["BLOCK_M"] == 128  # a window past the bound is none
    # heads of 128: one warp group over 64 queries within the graph buckets' bounds, 128 queries beyond
    assert launch_shape(128, 128) == {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 128, "num_warps": 4, "num_stages": 2}
    assert launch_shape(4096, 128) == {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 8,
                                       "num_stages": 3}
    for max_seqlen, head_dim, ieee, window in itertools.product((1, 7, 33, 64, 65, 255, 256, 512), (2, 8, 32, 64, 128),
                                                                (False, True), (0, 1, 64)):
        shape = launch_shape(max_seqlen, head_dim, ieee, window)
        assert min(shape["BLOCK_M"], shape["BLOCK_N"]) >= 16
        assert shape["BLOCK_D"] >= head_dim and shape["BLOCK_D"] & (shape["BLOCK_D"] - 1) == 0
        assert not ieee or max(shape["BLOCK_M"], shape["BLOCK_N"]) <= 32
        assert not windowed(max_seqlen, window) or shape["BLOCK_M"] <= 64
    assert rotate_shape(12, 64) == {"BLOCK_T": 8, "BLOCK_HEADS": 16, "BLOCK_H": 32, "num_warps": 4}
    for heads, head_dim in itertools.product((1, 2, 3, 12, 16, 40), (2, 8, 62, 64, 128)):
        shape = rotate_shape(heads, head_dim)
        assert shape["BLOCK_HEADS"] >= heads and shape["BLOCK_H"] >= head_dim // 2
        assert shape["BLOCK_T"] >= 1 and shape["BLOCK_T"] * shape["BLOCK_HEADS"] * shape["BLOCK_H"] <= 4096 * 2


# ---- the conventions, against transformers ------------------------------------------------------------------------


def _padded_batch(lengths, hidden, gen):
    """x [batch, longest, hidden] of dyadic values, the 2-D padding mask, and each row's positions (0-based)."""
    batch, seq = len(lengths), max(lengths)
    x = dyadic(gen, (batch, seq, hidden), 1 / 8, 2.0)
    keep = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
    return x, keep, torch.arange(seq)[None, :].expand(batch, seq)


def test_the_rotation_matches_transformers_gte(device):
    """GteAttention (transformers' GTE, eager) on a padded batch, with GteRotaryEmbedding at GTE's theta of 160000 and
    apply_rotary_pos_emb inside, against the op on the same rows packed: the same rotation (dimension i paired with
    i + d/2, turned by position * inv_freq, positions 0-based within each sequence). Turned the other way (negated
    frequencies) or paired as neighbours (2i, 2i + 1: GPT-J's convention, here the op on q and k with their
    columns interleaved) it is a different attention, so the test tells the conventions apart."""
    gte = pytest.importorskip("transformers.models.gte.modeling_gte")
    from transformers import GteConfig
    from transformers.masking_utils import create_bidirectional_mask

    hidden, heads, lengths = 64, 2, [150, 37, 1]
    config = GteConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=64,
                       rope_parameters={"rope_type": "default", "rope_theta": 160000.0},
                       attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(12)
    attention = gte.GteAttention(config).double().eval()
    rotary = gte.GteRotaryEmbedding(config)
    with torch.no_grad():
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            linear.weight.copy_(dyadic(gen, (hidden, hidden), 1 / 64, 0.25))
            linear.bias.copy_(dyadic(gen, (hidden,), 1 / 64, 0.5))
        attention.o_proj.weight.copy_(torch.eye(hidden, dtype=torch.float64))  # the context itself
        attention.o_proj.bias.zero_()
        x, keep, positions = _padded_batch(lengths, hidden, gen)
        mask = create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=keep.long())
        expected = attention(x, attention_mask=mask, position_embeddings=rotary(x, positions))[0][keep]
        rows = x[keep]
        qkv = torch.cat([attention.q_proj(rows), attention.k_proj(rows), attention.v_proj(rows)], dim=1)
    assert torch.equal(qkv.float().double(), qkv)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    inv_freq = rotary.inv_freq.float().to(device)
    assert torch.allclose(inv_freq.cpu(), inverse_frequencies(hidden // heads, 160000.0))

    def run(qkv, inv_freq):
        return _launch()(qkv.float().to(device), cu, max(lengths), heads, inv_freq)

    report = compare(run(qkv, inv_freq), expected, torch.float32)
    assert report.ok, report
    assert not compare(run(qkv, -inv_freq), expected, torch.float32).ok
    d = hidden // heads
    neighbours = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # (2i, 2i + 1) -> (i, i + d/2)
    columns = torch.cat([part * hidden + h * d + neighbours for part in (0, 1) for h in range(heads)]
                        + [torch.arange(2 * hidden, 3 * hidden)])
    assert not compare(run(qkv[:, columns], inv_freq), expected, torch.float32).ok


def test_the_window_matches_transformers_modernbert_local_attention(device):
    """ModernBERT's local layers: `local_attention` 128 is the whole window, config.sliding_window = 128 // 2 = 64,
    and transformers' sliding-window mask lets query i see key j when |i - j| <= 64, both ends included (the mask
    itself is checked here). ModernBertAttention of a sliding layer (eager, its local rotary theta of 10000, on a
    padded batch) equals the op with window=64 on the same rows packed; window 63 or 65 does not, so the boundary is
    tested."""
    modernbert = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    hidden, heads, lengths = 64, 2, [150, 37, 1]
    config = ModernBertConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=3, intermediate_size=64,
                              local_attention=128, attention_dropout=0.0)
    config._attn_implementation = "eager"
    layer = config.layer_types.index("sliding_attention")
    assert config.sliding_window == 64
    gen = torch.Generator().manual_seed(13)
    attention = modernbert.ModernBertAttention(config, layer_idx=layer).double().eval()
    rotary = modernbert.ModernBertRotaryEmbedding(config)
    with torch.no_grad():
        attention.Wqkv.weight.copy_(dyadic(gen, (3 * hidden, hidden), 1 / 64, 0.25))
        attention.Wo.weight.copy_(torch.eye(hidden, dtype=torch.float64))  # the context itself
        x, keep, positions = _padded_batch(lengths, hidden, gen)
        mask = create_bidirectional_sliding_window_mask(config=config, inputs_embeds=x, attention_mask=keep.long())
        i, j = torch.arange(max(lengths))[:, None], torch.arange(max(lengths))[None, :]
        seen = mask[:, 0] == 0  # additive: 0 where attended, the dtype's least elsewhere
        assert torch.equal(seen, ((i - j).abs() <= 64)[None] & keep[:, None, :])
        embeddings = rotary(x, positions, "sliding_attention")
        expected = attention(x, position_embeddings=embeddings, attention_mask=mask)[0][keep]
        qkv = attention.Wqkv(x[keep])
    assert torch.equal(qkv.float().double(), qkv)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    inv_freq = rotary.sliding_attention_inv_freq.float().to(device)
    assert torch.allclose(inv_freq.cpu(), inverse_frequencies(hidden // heads, 10000.0))

    def run(window):
        return _launch()(qkv.float().to(device), cu, max(lengths), heads, inv_freq, window)

    report = compare(run(config.sliding_window), expected, torch.float32)
    assert report.ok, report
    for window in (63, 65):
        assert not compare(run(window), expected, torch.float32).ok, window


# ---- decoders: grouped-query heads, causal attention, per-head q/k RMSNorm (Qwen3, Qwen2) --------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,heads,kv_heads,d,causal,norms", [
    ([7, 0, 130, 1], 4, 2, 16, True, True),        # Qwen3: groups of two, causal, q/k norms; several query blocks
    ([33, 5], 6, 1, 32, True, False),              # one key/value head for all (multi-query), Qwen2: no norms
    ([70, 3], 4, 4, 16, False, True),              # norms without grouping or causality
    ([1], 2, 1, 8, True, True),                    # a single token: its own value
])
def test_decoder_variants_match_the_formula(device, dtype, lengths, heads, kv_heads, d, causal, norms):
    _check_decoder(device, dtype, lengths, max(lengths), heads, kv_heads, d, causal, norms,
                   seed=sum(lengths) + heads + d)


def _check_decoder(device, dtype, lengths, bound, heads, kv_heads, d, causal, norms, seed, filler=5):
    """The decoder variant on fresh random inputs against the float64 formula: `filler` NaN rows past the sequences
    (never read; their output zeros), q/k norm weights of order 1 (Qwen3's start at ones), apart for q and k."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths) + filler
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    qkv[-filler:] = NAN
    q_norm = k_norm = None
    if norms:
        q_norm, k_norm = 1 + 0.5 * torch.randn(d, generator=gen), 1 + 0.5 * torch.randn(d, generator=gen)
        q_norm, k_norm = q_norm.to(device, dtype), k_norm.to(device, dtype)
    qkv = qkv.to(device, dtype)
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32, device=device)
    inv_freq = inverse_frequencies(d, 1000000.0).to(device)  # Qwen3's theta
    out = torch.full((t, heads * d), NAN, dtype=dtype, device=device)
    _launch()(qkv, cu, bound, heads, inv_freq, num_kv_heads=kv_heads, causal=causal, q_norm=q_norm,
              k_norm=k_norm, norm_eps=1e-6, out=out)
    end = int(cu[-1])
    expected = formula_float64(OP, (qkv[:end], cu, bound, heads, inv_freq, 0, kv_heads, causal, q_norm, k_norm, 1e-6),
                               {})
    report = compare(out[:end], expected, dtype)
    assert report.ok, report
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "rows outside the sequences must be zeros"


def test_causal_attention_never_reads_a_later_key(device):
    """A NaN key reaches, under causal attention, the rows at and after it in its sequence only; without causality,
    every row of its sequence. (A NaN value would reach the earlier rows too, through 0 x NaN in p v, as it does in
    SDPA: only the scores are masked.)"""
    heads, kv_heads, d, lengths = 2, 1, 16, [20, 9]
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(sum(lengths), (heads + 2 * kv_heads) * d, generator=gen)
    qkv[12, heads * d + 3] = NAN  # the first sequence's key at position 12, column 3 of the one key head
    qkv = qkv.to(device, torch.float32)
    cu = torch.tensor([0, 20, 29], dtype=torch.int32, device=device)
    inv_freq = inverse_frequencies(d).to(device)
    causal = _launch()(qkv, cu, 20, heads, inv_freq, num_kv_heads=kv_heads, causal=True).isnan().all(dim=1).cpu()
    full = _launch()(qkv, cu, 20, heads, inv_freq, num_kv_heads=kv_heads).isnan().all(dim=1).cpu()
    assert causal.tolist() == [False] * 12 + [True] * 8 + [False] * 9
    assert full.tolist() == [True] * 20 + [False] * 9


def test_decoder_arguments_are_checked(device):
    launch = _launch()
    qkv = torch.randn(5, 8 * 16, device=device)  # 4 query heads and 2 key/value heads of 16
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    inv_freq = inverse_frequencies(16).to(device)
    with pytest.raises(ValueError, match="3 key/value heads do not divide 4 query heads"):
        launch(qkv, cu, 5, 4, inv_freq, num_kv_heads=3)
    with pytest.raises(ValueError, match="qkv must be \\[T, \\(heads \\+ 2 kv_heads\\) d\\] = \\[T, 10 d\\]"):
        launch(qkv, cu, 5, 6, inv_freq, num_kv_heads=2)
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        launch(qkv, cu, 5, 4, inv_freq, num_kv_heads=2, q_norm=torch.ones(16, device=device))
    with pytest.raises(ValueError, match="k_norm must be the head's \\[16\\] norm weight"):
        launch(qkv, cu, 5, 4, inv_freq, num_kv_heads=2, q_norm=torch.ones(16, device=device),
               k_norm=torch.ones(8, device=device))
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of shape \\(5, 64\\)"):
        launch(qkv, cu, 5, 4, inv_freq, num_kv_heads=2, out=torch.empty(5, 32, device=device))


@pytest.mark.slow  # importing transformers takes most of its time
def test_the_decoder_variant_matches_transformers_qwen3_attention(device):
    """Qwen3Attention (eager, its rotary embedding at theta 1e6, float64, causal mask, grouped heads, q_norm and
    k_norm with weights apart from ones) on a padded batch equals the op on the same rows packed, q, k and v taken
    from its own projections; without the norms, or without causality, it does not."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    hidden, heads, kv_heads, d, lengths = 64, 4, 2, 16, [21, 6, 1]
    config = Qwen3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                         num_hidden_layers=1, intermediate_size=64, rope_theta=1000000.0, attention_dropout=0.0)
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(17)
    attention = qwen3.Qwen3Attention(config, layer_idx=0).double().eval()
    rotary = qwen3.Qwen3RotaryEmbedding(config)
    with torch.no_grad():
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            projection.weight.copy_(dyadic(gen, projection.weight.shape, 1 / 64, 0.25))
        attention.o_proj.weight.copy_(torch.eye(hidden, dtype=torch.float64))  # heads x d = hidden: the context
        attention.q_norm.weight.copy_(1 + dyadic(gen, (d,), 1 / 8, 0.5))
        attention.k_norm.weight.copy_(1 + dyadic(gen, (d,), 1 / 8, 0.5))
        x, keep, positions = _padded_batch(lengths, hidden, gen)
        causal = torch.tril(torch.ones(max(lengths), max(lengths), dtype=torch.bool))
        mask = torch.where(causal[None, None] & keep[:, None, None, :], 0.0, float("-inf")).double()
        cos, sin = rotary(x, positions)
        expected = attention(x, position_embeddings=(cos.double(), sin.double()), attention_mask=mask)[0][keep]
        rows = x[keep]
        qkv = torch.cat([attention.q_proj(rows), attention.k_proj(rows), attention.v_proj(rows)], dim=1)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    inv_freq = rotary.inv_freq.float().to(device)
    norms = {"q_norm": attention.q_norm.weight.float().to(device), "k_norm": attention.k_norm.weight.float().to(device),
             "norm_eps": config.rms_norm_eps}

    def run(causal=True, **kwargs):
        return _launch()(qkv.float().to(device), cu, max(lengths), heads, inv_freq, num_kv_heads=kv_heads,
                         causal=causal, **kwargs)

    report = compare(run(**norms), expected, torch.float32)
    assert report.ok, report
    assert not compare(run(), expected, torch.float32).ok
    assert not compare(run(causal=False, **norms), expected, torch.float32).ok


# ---- the GPU: the models' shapes, graphs ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,bound,window", [
    ([16], 16, 0),                                          # a single short request
    ([128] * 32, 128, 0),                                   # GTE-base b32 s128 fixed
    ([7, 120, 33, 512, 1, 128, 90, 3, 0, 0], 512, 0),       # mixed lengths, filler sequences
    ([1024, 700, 64, 3, 0], 1024, 64),                      # ModernBERT's local layers
    ([60, 9], 64, 64),                                      # a window past the bound: none
])
def test_gte_and_modernbert_shapes_on_the_gpu(dtype, lengths, bound, window):
    qkv, cu, inv_freq = _inputs(lengths, 768, 12, dtype, "cuda", filler=13, seed=len(lengths), theta=160000.0)
    out = torch.full((qkv.shape[0], 768), NAN, dtype=dtype, device="cuda")
    _launch()(qkv, cu, bound, 12, inv_freq, window, out=out)
    _check(out, qkv, cu, bound, 12, inv_freq, window, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,bound", [
    ([128] * 32, 128),                                      # Qwen3-0.6B b32 s128: 64 queries on one warp group
    ([7, 120, 33, 512, 1, 128, 90, 3, 0, 0], 512),          # a graph bucket's bound, mixed lengths, filler
    ([1500, 700, 64, 3, 0], 2048),                          # a long input's bound: 128 queries, three stages
])
def test_qwen3_shapes_on_the_gpu(dtype, lengths, bound):
    """Qwen3-Embedding-0.6B's heads (16 query heads of 128 over 8 key/value heads), causal, with q/k norms, in
    each of its launch shapes."""
    _check_decoder("cuda", dtype, lengths, bound, 16, 8, 128, True, True, seed=len(lengths) + bound, filler=11)


@pytest.mark.gpu
def test_positions_up_to_gte_and_modernbert_longest_on_the_gpu():
    """8192 positions (GTE's and ModernBERT's longest): the angles reach 8191 radians, where a fast sine's range
    reduction would cost accuracy; libdevice's holds the fp16 tolerance against the float64 rotation. The reference in
    fp32 (the same rounded angles) gives the same answer."""
    qkv, cu, inv_freq = _inputs([8192], 128, 2, torch.float16, "cuda", filler=3, seed=30, theta=160000.0)
    out = _launch()(qkv, cu, 8192, 2, inv_freq)
    _check(out, qkv, cu, 8192, 2, inv_freq, 0, torch.float16)
    assert compare(out, reference.rotary_attention(qkv.float(), cu, 8192, 2, inv_freq), torch.float16).ok


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_inputs():
    launch = _launch()
    qkv, cu, inv_freq = _inputs([9, 30, 2], 768, 12, torch.float16, "cuda", filler=7, seed=4)
    out = torch.empty((qkv.shape[0], 768), dtype=torch.float16, device="cuda")
    launch(qkv, cu, 64, 12, inv_freq, 8, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(qkv, cu, 64, 12, inv_freq, 8, out=out)
    qkv.copy_(_inputs([9, 30, 2], 768, 12, torch.float16, "cuda", filler=7, seed=5)[0])
    cu.copy_(torch.tensor([0, 20, 41, 41], dtype=torch.int32))  # new lengths, same bound
    inv_freq.copy_(inverse_frequencies(64, 160000.0))
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, qkv, cu, 64, 12, inv_freq, 8, torch.float16)
