"""`python -m bench kernels` end to end on the CPU (Triton interpreter, tiny shapes): it must not rot between GPU
runs. It asserts the results' structure, never a time."""

from __future__ import annotations

import torch

from bench import kernels as suite
from bench import results as store
from bench.__main__ import main


def test_fused_ops_and_gemm_epilogues_on_the_interpreter(tmp_path):
    out = tmp_path / "kernels.json"
    assert main(["kernels", "fused-ops", "gemm-epilogues", "--device", "cpu", "--providers", "triton", "eager",
                 "--ops", "bias_gelu", "add_layer_norm", "--dtypes", "float32", "--shapes", "8x64",
                 "--gemm-shapes", "tiny ffn-in 8 tokens", "tiny ffn-out 8 tokens", "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == [] and doc["gpu"] == "cpu"
    fused = doc["scenarios"]["fused-ops"]
    assert fused["complete"] and fused["summary"]["copy_gbps"] > 0
    assert fused["header"]["command"].startswith("python -m bench kernels fused-ops")
    cells = {(r["op"], r["provider"]) for r in fused["results"]}
    assert cells == {(op, p) for op in ("bias_gelu", "add_layer_norm") for p in ("triton", "eager")}
    assert all(r["accurate"] and r["us"] > 0 and r["gbps"] > 0 and r["shape"] == "8x64" for r in fused["results"])
    # each cell beside a copy of its own bytes, timed the same way
    copies = fused["summary"]["same_bytes_copy_us"]
    assert set(copies) == {str(r["bytes"]) for r in fused["results"]} and all(us > 0 for us in copies.values())
    assert all(r["copy_us"] == copies[str(r["bytes"])]
               and r["pct_same_bytes_copy"] == 100 * r["copy_us"] / r["us"] for r in fused["results"])
    gemm = doc["scenarios"]["gemm-epilogues"]["results"]
    assert {(r["op"], r["provider"]) for r in gemm} == {
        (op, p) for op in ("linear_bias_gelu", "linear_add_layer_norm") for p in ("triton", "eager")}
    assert all(r["accurate"] and r["tflops"] > 0 for r in gemm)


def test_gemm_fp8_on_the_cpu(tmp_path):
    out = tmp_path / "kernels.json"
    assert main(["kernels", "gemm-fp8", "--device", "cpu", "--fp8-shapes", "tiny 8 tokens", "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    block = doc["scenarios"]["gemm-fp8"]
    assert block["complete"] and block["settings"]["shapes"] == ["tiny 8 tokens"]
    rows = block["results"]
    assert {(r["op"], r["provider"]) for r in rows} == {
        (gemm, p) for gemm in ("qkv", "attn_out", "ffn_in", "ffn_out") for p in suite.FP8_PROVIDERS}
    assert {r["shape"] for r in rows if r["op"] == "ffn_out"} == {"8x64x16"}
    assert all(r["accurate"] and r["us"] > 0 and r["tflops"] > 0 for r in rows)
    for gemm in ("qkv", "attn_out", "ffn_in", "ffn_out"):
        error = {r["provider"]: r["rel_l2"] for r in rows if r["op"] == gemm}
        # the quantization is real (E4M3's rounding shows) and the same whether timed with the GEMM or not
        assert error["fp16"] < 1e-3 < error["fp8"] <= suite.FP8_REL_L2
        assert error["fp8 + quantize"] == error["fp8"]
    layer = block["summary"]["layers"]["tiny 8 tokens"]
    assert layer["us"]["fp16"] == sum(r["us"] for r in rows if r["provider"] == "fp16")
    assert layer["fp8_speedup"] == layer["us"]["fp16"] / layer["us"]["fp8"]


def test_the_same_bytes_copy_moves_the_cells_bytes(monkeypatch):
    """Half the cell's bytes read and half written: a float32 tensor of nbytes / 8 elements copied once."""
    copied = []

    def fake_cell_us(fn, device):
        copied.append(fn)
        return 1.0

    monkeypatch.setattr(suite, "cell_us", fake_cell_us)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src: copied.append((dst.numel(), src.numel(), dst.dtype)))
    assert suite.same_bytes_copy_us(12_582_912, "cpu") == 1.0
    copied[0]()
    dst_numel, src_numel, dtype = copied[1]
    assert dtype == torch.float32 and dst_numel == src_numel and 2 * src_numel * 4 == 12_582_912


def test_min_bytes_counts_each_matrix_once():
    assert suite.min_bytes("add_layer_norm", 8, 64, torch.float32) == 3 * 8 * 64 * 4
    assert suite.min_bytes("layer_norm", 8, 64, torch.bfloat16) == 2 * 8 * 64 * 2
    assert suite.min_bytes("embedding_layer_norm", 8, 64, torch.float16) == 2 * 8 * 64 * 2 + 3 * 8 * 8


def test_attention_on_the_interpreter(tmp_path):
    """The attention scenario's tiny cases, one per op (and a sliding window): every cell accurate, FLOPs counted."""
    out = tmp_path / "kernels.json"
    cases = ["tiny b3 varlen s16", "tiny deberta b3 varlen s40", "tiny rotary b3 varlen s16", "tiny local b2 s40"]
    assert main(["kernels", "attention", "--device", "cpu", "--providers", "triton", "eager",
                 "--attention-shapes", *cases, "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    rows = doc["scenarios"]["attention"]["results"]
    assert {(r["case"], r["op"], r["provider"]) for r in rows} == {
        (case, suite.ATTENTION_SHAPES[case][0], p) for case in cases for p in ("triton", "eager")}
    assert all(r["accurate"] and r["tflops"] > 0 for r in rows)


def test_attention_flops_count_the_pairs_within_the_window():
    cu = torch.tensor([0, 40, 43, 43])  # lengths 40, 3 and 0
    assert suite.attention_flops(cu, 32) == 4 * (40 * 40 + 3 * 3) * 32
    # window 4: 40 + 2 x (36 + 37 + 38 + 39) pairs in the first, all 9 in the second (its farthest distance is 2)
    assert suite.attention_flops(cu, 32, window=4) == 4 * (40 + 2 * (36 + 37 + 38 + 39) + 9) * 32
    # DeBERTa's two position terms: a dot product of head_dim per pair each
    assert suite.attention_flops(cu, 32, terms=2) == 8 * (40 * 40 + 3 * 3) * 32


def test_padded_disentangled_attention_is_the_reference():
    """The eager provider's DeBERTa attention (transformers' way: q Pk^T and k Pq^T against the whole table, gathered
    into SDPA's mask on a padded block) is the op: the same as the reference on a packed batch with an empty sequence
    and filler rows, both terms and each alone."""
    from fusedserve.kernels import reference

    args = list(suite.attention_inputs("tiny deberta b3 varlen s40", torch.float64, "cpu", seed=4))
    qkv, cu = args[0], args[1]
    args[0] = torch.cat([qkv, torch.zeros(2, qkv.shape[1], dtype=torch.float64)])  # two filler rows
    args[1] = torch.cat([cu, cu[-1:]])  # an empty sequence
    for keep in ((True, True), (True, False), (False, True)):
        call = [a if i not in (4, 5) or keep[i - 4] else None for i, a in enumerate(args)]
        torch.testing.assert_close(suite.padded_disentangled_attention(*call),
                                   reference.disentangled_attention(*call), rtol=1e-10, atol=1e-10)


def test_splade_on_the_interpreter(tmp_path):
    """The splade scenario's tiny case: every cell accurate, FLOPs counted; peak memory is a GPU's only."""
    out = tmp_path / "kernels.json"
    assert main(["kernels", "splade", "--device", "cpu", "--providers", "triton", "cuda", "eager",
                 "--splade-shapes", "tiny b3 s5", "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    block = doc["scenarios"]["splade"]
    assert block["complete"] and block["settings"]["shapes"] == ["tiny b3 s5"]
    rows = block["results"]
    # the CUDA backend has no splade_pool: left out, not failing
    assert {(r["case"], r["op"], r["provider"], r["dtype"]) for r in rows} == {
        ("tiny b3 s5", "splade_pool", p, "float32") for p in ("triton", "eager")}
    assert all(r["accurate"] and r["tflops"] > 0 and r["flops"] == 2 * 15 * 16 * 70 and r["peak_bytes"] is None
               for r in rows)


def test_unfused_splade_pool_is_the_reference():
    """The eager provider's SPLADE pooling (scatter-reduce over the packed batch, filler rows ignored) is the op: the
    same as the reference, empty and filler sequences included."""
    from fusedserve.kernels import reference

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(20, 8, generator=gen, dtype=torch.float64), torch.randn(20, generator=gen).double()
    cu = torch.tensor([0, 4, 4, 9, 10], dtype=torch.int32)  # an empty sequence; rows 10 and 11 are filler
    x[10:] = float("nan")
    torch.testing.assert_close(suite.unfused_splade_pool(x, weight, bias, cu).double(),
                               reference.splade_pool(x, weight, bias, cu), rtol=1e-6, atol=1e-6)


def test_decoder_ops_on_the_interpreter(tmp_path):
    """The decoder ops beside transformers' formulas (eager here; compile is the GPU's), each checked against the
    float64 reference; Liger-Kernel is not installed here, and the summary says so instead of failing."""
    out = tmp_path / "kernels.json"
    assert main(["kernels", "decoder-ops", "--device", "cpu", "--decoder-providers", "ours", "eager", "liger",
                 "--dtypes", "float32", "--decoder-shapes", "tiny 24 tokens", "--out", str(out)]) == 0
    block = store.load(out)["scenarios"]["decoder-ops"]
    assert block["complete"]
    assert {(r["op"], r["provider"]) for r in block["results"]} == {
        (op, p) for op in suite.DECODER_OPS for p in ("ours", "eager")}
    assert all(r["accurate"] and r["us"] > 0 for r in block["results"])
    assert all((r["tflops"] > 0) == (r["op"] == "swiglu") for r in block["results"] if r["tflops"] is not None)
    assert "liger" in block["summary"]["unavailable"]
    from bench import report

    table = report.tables(out)
    assert "| ours vs best of compile, liger |" in table and table.count("| tiny 24 tokens |") == len(suite.DECODER_OPS)


def test_the_decoder_summary_takes_the_best_peer_and_the_large_cells():
    def row(op, provider, us, mb):
        return {"op": op, "dtype": "float16", "shape": "s", "provider": provider, "us": us, "bytes": mb * 1e6}

    rows = [row("rms_norm", "ours", 10.0, 30), row("rms_norm", "compile", 12.0, 30), row("rms_norm", "liger", 11.0, 30),
            row("swiglu", "ours", 8.0, 40), row("swiglu", "compile", 6.0, 40),
            row("add_rms_norm", "ours", 1.0, 5), row("add_rms_norm", "compile", 4.0, 5)]  # under 25 MB: not counted
    summary = suite.decoder_summary(rows)
    assert summary["vs_best_peer"]["rms_norm|float16|s"]["vs_best_peer"] == 1.1
    assert summary["worst_vs_best_peer"] == 0.75
    assert abs(summary["geomean_vs_best_peer"] - (1.1 * 0.75) ** 0.5) < 1e-9
