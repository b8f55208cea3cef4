"""Compile Triton kernels for a GPU architecture on a machine without one:
`python -m fusedserve.kernels.triton.compile_check`.

Why: the interpreter (TRITON_INTERPRET=1, how CI runs the kernels) executes the Python body of a kernel and never
runs the compiler, so errors only a compile finds pass CI and first show on the GPU: for one, a variable assigned in
both branches of a runtime `if` with two different types (fp32 in one, fp16 in the other) is a CompilationError for
the compiler and runs fine on the interpreter. triton.compile lowers a kernel through TTIR, TTGIR, LLVM IR and PTX
to a cubin with the ptxas that ships in Triton's wheel; none of that needs a driver.

Covered: the kernels of the few-token layer (qkv_attention and attention_partials, ffn_partials, the LayerNorm
kernel summing partials) at the model's shapes, in fp16, bf16 and fp32; and in fp16 every kernel that can be
launched with programmatic dependent launch (those, embedding + LayerNorm, segment_mean) with it, whose PTX must
then hold the grid-dependency wait and release (kernels/triton/_common.py, pdl_sync), the wait before any load or
store; and the GELU kernels (LayerNorm + GELU in both GELU forms at 768 columns in three exact blocks and at a
padded width, bias + residual + GELU on an exact and a padded column block: the inline-PTX reciprocal is compiled
only here); the RMSNorm entry of the LayerNorm body; and the packed attention kernels (relative, and rotary with
its rotation pass, GTE's, ModernBERT's windowed and Qwen3's causal grouped-query configurations, and DeBERTa's
disentangled one with each combination of its position terms); and the FP8 precision's row-quantizing kernels. Must
run without TRITON_INTERPRET (under it `triton.jit` builds interpreter objects the compiler cannot take);
tests/kernels/test_triton_compile.py runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}


def _signature(fn, types: dict, constexprs: dict) -> dict:
    missing = set(fn.arg_names) - set(types) - set(constexprs)
    if missing:
        raise ValueError(f"{fn.__name__}: no type for {sorted(missing)}")
    return {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}


PDL_PTX = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")


def cases():
    """(name, jit function, argument types, constexprs, options) for every kernel configuration checked: options is
    the number of warps, or the compile options (num_warps, num_stages) of a kernel launched with both; a case whose
    constexprs set USE_PDL is compiled with launch_pdl."""
    few_token = list(_few_token_cases())
    for name, fn, types, constexprs, warps in few_token:
        yield name, fn, types, {**constexprs, "USE_PDL": False}, warps
    for name, fn, types, constexprs, warps in few_token:
        if name.split()[1] == "fp16" and ("seq=16" in name or "chunk=64" in name or "parts=12" in name):
            yield f"{name} pdl", fn, types, {**constexprs, "USE_PDL": True}, warps
    yield from _pdl_cases()
    yield from _gelu_cases()
    yield from _rms_cases()
    yield from _attention_cases()
    yield from _fp8_cases()


_NORM_TYPES = {"X": "*fp16", "R": "*fp16", "T": "*fp16", "IDX_X": "*i64", "IDX_R": "*i64", "IDX_T": "*i64",
               "BIAS": "*fp16", "W": "*fp16", "B": "*fp16", "Y": "*fp16", "S": "*fp16", "stride_x": "i32",
               "stride_r": "i32", "stride_t": "i32", "stride_y": "i32", "stride_s": "i32", "stride_p": "i32",
               "M": "i32", "N": "i32", "eps": "fp32", "M_BUCKET": "i32"}


def _norm_case(ptr: str = "*fp16", **constexprs) -> tuple[dict, dict]:
    """Argument types and constexprs of the LayerNorm-family kernel: a plain fp16 layer_norm of 768 columns
    (three exact blocks) unless `constexprs` says otherwise; `ptr` is the activations' type."""
    import torch

    from fusedserve.kernels.triton._norm import l2_policies

    types = {name: ptr if t == "*fp16" else t for name, t in _NORM_TYPES.items()}
    dtype = {"*fp16": torch.float16, "*bf16": torch.bfloat16}.get(ptr, torch.float32)
    base = {"PARTS": 1, "SOURCES": 1, "GATHER": False, "HAS_BIAS": False, "STORE_SUM": False, "GELU": 0,
            "F64": False, "WIDE": False, "NCHUNK": 3, "CHUNK": 256, "EVEN_COLS": True, "BLOCK_M": 2,
            "USE_PDL": False, **l2_policies(constexprs.get("GELU", 0), dtype)}
    return types, {**base, **constexprs}


def _pdl_cases():
    from fusedserve.kernels.triton._norm import _norm_kernel
    from fusedserve.kernels.triton.segment_mean import _segment_mean_kernel

    types, constexprs = _norm_case(SOURCES=3, GATHER=True, NCHUNK=3, CHUNK=128, BLOCK_M=1, USE_PDL=True)
    yield "embedding_layer_norm fp16 pdl", _norm_kernel.fn, types, constexprs, 2
    i32, ptr = "i32", "*fp16"
    types = {"x_ptr": ptr, "cu_ptr": "*i32", "y_ptr": "*fp32", "T": i32, "H": i32, "stride_x": i32, "stride_y": i32}
    yield ("segment_mean fp16 pdl", _segment_mean_kernel, types,
           {"BLOCK_T": 32, "BLOCK_H": 128, "OUT_F64": False, "USE_PDL": True}, 4)


def _gelu_cases():
    """The GELU kernels at the widths the encoders use: exact column blocks and a padded one."""
    from fusedserve.kernels.triton._norm import _norm_kernel
    from fusedserve.kernels.triton._pointwise import _bias_gelu_kernel

    for dname, ptr in DTYPES.items():
        for gelu in (1, 2):
            types, constexprs = _norm_case(ptr, GELU=gelu)
            yield f"layer_norm_gelu {dname} 768 gelu={gelu}", _norm_kernel.fn, types, constexprs, 1
        types, constexprs = _norm_case(ptr, GELU=1, NCHUNK=1, CHUNK=512, EVEN_COLS=False, BLOCK_M=4)
        yield f"layer_norm_gelu {dname} 300", _norm_kernel.fn, types, constexprs, 4
        types = {"X": ptr, "BIAS": ptr, "R": ptr, "Y": ptr, "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
                 "M": "i32", "N": "i32", "M_BUCKET": "i32"}
        for block_n, even in ((512, True), (512, False)):
            yield (f"bias_residual_gelu {dname} block {block_n}{'' if even else ' padded'}", _bias_gelu_kernel.fn,
                   types, {"HAS_RESIDUAL": True, "GELU": 1, "F64": False, "WIDE": False, "BLOCK_N": block_n,
                           "EVEN_N": even, "BLOCK_M": 8}, 4)


def _rms_cases():
    """The LayerNorm body's RMS entry (rms_norm, add_rms_norm): add + RMSNorm with its sum at Qwen3-0.6B's 1024
    columns (with PDL) and in three exact blocks, RMSNorm on a padded block."""
    from fusedserve.kernels.triton._norm import _rms_norm_kernel

    for ptr, add, nchunk, chunk, block_m, warps, pdl in (("*bf16", True, 1, 1024, 2, 4, True),
                                                          ("*fp16", True, 3, 256, 2, 1, False),
                                                          ("*fp32", False, 1, 512, 4, 4, False)):
        types = {"X": ptr, "R": ptr, "W": ptr, "Y": ptr, "S": ptr, "stride_x": "i32", "stride_r": "i32",
                 "stride_y": "i32", "stride_s": "i32", "M": "i32", "N": "i32", "eps": "fp32", "M_BUCKET": "i32"}
        constexprs = {"SOURCES": 2 if add else 1, "STORE_SUM": add, "F64": False, "WIDE": False, "NCHUNK": nchunk,
                      "CHUNK": chunk, "EVEN_COLS": nchunk == 3 or chunk == 1024, "BLOCK_M": block_m, "USE_PDL": pdl}
        name = f"{'add_rms_norm' if add else 'rms_norm'} {ptr[1:]} {nchunk * chunk}{' pdl' if pdl else ''}"
        yield name, _rms_norm_kernel.fn, types, constexprs, warps


def _fp8_cases():
    """PRECISION=fp8's row-quantizing kernels (E4M3 stores, the bit-level rounding) at BERT-base's widths with their
    launch configuration (kernels/triton/fp8.py launch_config): the hidden size and the FFN's inner width, in both
    half types."""
    from fusedserve.kernels.triton import fp8

    for ptr in ("*fp16", "*bf16"):
        for cols in (768, 3072):
            block, rows, warps = fp8.launch_config(cols)
            shape = {"ROWS": rows, "BLOCK": block}
            common = {"Q": "*fp8e4nv", "S": "*fp32", "n_rows": "i32", "cols": "i32", "stride_x": "i32",
                      "stride_q": "i32"}
            yield (f"quantize_rows {ptr[1:]} {cols}", fp8._quantize_kernel, {"X": ptr, **common}, shape, warps)
            yield (f"bias_gelu_quantize {ptr[1:]} {cols}", fp8._bias_gelu_quantize_kernel,
                   {"X": ptr, "BIAS": ptr, **common}, {**shape, "GELU": 1}, warps)
            yield (f"add_layer_norm_quantize {ptr[1:]} {cols}", fp8._add_layer_norm_quantize_kernel,
                   {"X": ptr, "R": ptr, "BIAS": ptr, "W": ptr, "B": ptr, "Y": ptr, "eps": "fp32", "stride_r": "i32",
                    "stride_y": "i32", **common}, shape, warps)


def _attention_cases():
    """The packed attention kernels with their launch rules' options at the models' shapes: relative_attention
    (MPNet-base), disentangled_attention (DeBERTa-v3-base, each combination of its position terms) and
    rotary_attention's rotation pass and attention (GTE-base; ModernBERT's window; Qwen3-Embedding-0.6B's causal
    grouped heads of 128 with q/k norms, within a graph bucket's bound and a long input's), each dtype, half precision
    also with PDL."""
    from fusedserve.kernels.triton import disentangled_attention, relative_attention, rotary_attention

    for ptr, max_seqlen, pdl in (("*fp16", 128, True), ("*bf16", 512, False), ("*fp32", 128, False)):
        shape = relative_attention.launch_shape(max_seqlen, 64, ptr == "*fp32")
        options = {"num_warps": shape.pop("num_warps"), "num_stages": shape.pop("num_stages")}
        types = {"qkv_ptr": ptr, "cu_ptr": "*i32", "bias_ptr": "*fp32", "y_ptr": ptr, "T": "i32", "H": "i32",
                 "R": "i32", "qk_scale": "fp32", "stride_qkv": "i32", "stride_bias": "i32", "stride_y": "i32"}
        yield (f"relative_attention {ptr[1:]} s{max_seqlen}{' pdl' if pdl else ''}",
               relative_attention._relative_attention_kernel, types,
               {**shape, "HEAD_DIM": 64, "IEEE": ptr == "*fp32", "USE_PDL": pdl}, options)
    # DeBERTa-v3-base's heads of 64: both position terms, each alone and neither (pos_att_type), at a single request's
    # bound and a graph bucket's
    for ptr, max_seqlen, terms, pdl in (("*fp16", 128, ("c2p", "p2c"), True), ("*bf16", 512, ("c2p", "p2c"), False),
                                        ("*fp32", 128, ("c2p", "p2c"), False), ("*fp16", 16, ("c2p", "p2c"), False),
                                        ("*fp16", 512, ("c2p",), False), ("*bf16", 128, ("p2c",), False),
                                        ("*fp16", 128, (), False)):
        shape = disentangled_attention.launch_shape(max_seqlen, 64, ptr == "*fp32")
        options = {"num_warps": shape.pop("num_warps"), "num_stages": shape.pop("num_stages")}
        types = {"qkv_ptr": ptr, "cu_ptr": "*i32", "rows_ptr": "*i64", "pk_ptr": ptr, "pq_ptr": ptr, "y_ptr": ptr,
                 "T": "i32", "H": "i32", "R": "i32", "P": "i32", "qk_scale": "fp32", "stride_qkv": "i32",
                 "stride_pk": "i32", "stride_pq": "i32", "stride_y": "i32"}
        yield (f"disentangled_attention {ptr[1:]} s{max_seqlen} {'+'.join(terms) or 'content'}{' pdl' if pdl else ''}",
               disentangled_attention._disentangled_attention_kernel, types,
               {**shape, "HEAD_DIM": 64, "C2P": "c2p" in terms, "P2C": "p2c" in terms, "IEEE": ptr == "*fp32",
                "USE_PDL": pdl}, options)
    for ptr, max_seqlen, window, pdl, (d, heads, kv_heads, decoder) in (
            ("*fp16", 128, 0, True, (64, 12, 12, False)), ("*bf16", 512, 0, False, (64, 12, 12, False)),
            ("*bf16", 1024, 64, False, (64, 12, 12, False)), ("*fp32", 128, 0, False, (64, 12, 12, False)),
            ("*bf16", 512, 0, True, (128, 16, 8, True)), ("*bf16", 2048, 0, False, (128, 16, 8, True))):
        label = f"{ptr[1:]} s{max_seqlen} w{window} {heads}/{kv_heads}x{d}{' pdl' if pdl else ''}"
        shape = rotary_attention.launch_shape(max_seqlen, d, ptr == "*fp32", window)
        options = {"num_warps": shape.pop("num_warps"), "num_stages": shape.pop("num_stages")}
        types = {"qk_ptr": ptr, "v_ptr": ptr, "cu_ptr": "*i32", "y_ptr": ptr, "T": "i32", "window": "i32",
                 "qk_scale": "fp32", "stride_qk": "i32", "stride_v": "i32", "stride_y": "i32"}
        yield (f"rotary_attention {label}", rotary_attention._rotary_attention_kernel, types,
               {**shape, "HEAD_DIM": d, "HEADS": heads, "KV_HEADS": kv_heads, "IEEE": ptr == "*fp32",
                "WINDOWED": rotary_attention.windowed(max_seqlen, window), "CAUSAL": decoder, "USE_PDL": pdl}, options)
        rotate = rotary_attention.rotate_shape(heads, d)
        types = {"qkv_ptr": ptr, "cu_ptr": "*i32", "inv_freq_ptr": "*fp32", "q_norm_ptr": ptr, "k_norm_ptr": ptr,
                 "qk_ptr": ptr, "T": "i32", "eps": "fp32", "stride_qkv": "i32", "stride_qk": "i32"}
        yield (f"rotary_attention rotate {label}", rotary_attention._rotate_kernel, types,
               {"HEAD_DIM": d, "HEADS": heads, "KV_HEADS": kv_heads, "HAS_NORM": decoder, "USE_PDL": pdl,
                **{key: rotate[key] for key in ("BLOCK_T", "BLOCK_HEADS", "BLOCK_H")}}, rotate["num_warps"])


def _few_token_cases():
    from fusedserve.kernels.triton._norm import _norm_kernel
    from fusedserve.kernels.triton.ffn_partials import _ffn_partials_kernel
    from fusedserve.kernels.triton.qkv_attention import _qkv_attention_kernel, launch_shape

    i32, f32 = "i32", "fp32"
    for dname, ptr in DTYPES.items():
        ieee = dname == "fp32"
        # MiniLM (head_dim 32, 16 tokens) and BERT-base (head_dim 64, 128 tokens: several query and key blocks)
        for hidden, heads, seq in ((384, 12, 16), (768, 12, 128)):
            shape = launch_shape(seq, hidden // heads, hidden)
            warps = shape.pop("num_warps")
            shape.pop("parts")
            for out_proj in (False, True):
                types = {"x_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "cu_ptr": "*i32",
                         "y_ptr": "*fp32" if out_proj else ptr, "wo_ptr": ptr, "T": i32, "H": i32, "D": i32,
                         "qk_scale": f32, "stride_x": i32, "stride_w": i32, "stride_y": i32, "stride_wo": i32}
                yield (f"qkv_attention {dname} H={hidden} seq={seq}{' out_proj' if out_proj else ''}",
                       _qkv_attention_kernel, types, {**shape, "OUT_PROJ": out_proj, "IEEE": ieee}, warps)
        types = {"x_ptr": ptr, "w1_ptr": ptr, "b1_ptr": ptr, "w2_ptr": ptr, "p_ptr": "*fp32", "T": i32, "H": i32,
                 "CHUNK": i32, "stride_x": i32, "stride_w1": i32, "stride_w2": i32}
        for chunk in (64, 128):  # the encoder's default chunk and the widest the kernel takes (MAX_CHUNK)
            yield (f"ffn_partials {dname} chunk={chunk}", _ffn_partials_kernel, types,
                   {"MODE": 1, "IEEE": ieee, "BLOCK_M": 16, "BLOCK_I": chunk, "BLOCK_K": 64, "BLOCK_N": 64}, 4)
        for parts in (12, 24):
            types, constexprs = _norm_case(ptr, PARTS=parts, SOURCES=2, HAS_BIAS=True, NCHUNK=3, CHUNK=128,
                                           BLOCK_M=1)
            types["X"] = "*fp32"
            yield f"partial_add_layer_norm {dname} parts={parts}", _norm_kernel.fn, types, constexprs, 2


def _check_pdl_ptx(ptx: str) -> None:
    """A kernel compiled with PDL holds the wait and the release, and no memory access comes before the wait."""
    missing = [op for op in PDL_PTX if op not in ptx]
    if missing:
        raise AssertionError(f"compiled with PDL but its PTX lacks {', '.join(missing)}")
    first = re.search(r"\b(ld|st|cp\.async|atom|red)\.(global|shared)", ptx)
    if first and first.start() < ptx.index(PDL_PTX[0]):
        raise AssertionError(f"a memory access precedes {PDL_PTX[0]} in the PTX: {first.group(0)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: Hopper)")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failed = GPUTarget("cuda", args.arch, 32), 0
    for name, fn, types, constexprs, options in cases():
        if args.k not in name:
            continue
        start = time.perf_counter()
        pdl = constexprs.get("USE_PDL", False)
        options = {"num_warps": options} if isinstance(options, int) else options
        warps = options["num_warps"]
        try:
            source = ASTSource(fn=fn, signature=_signature(fn, types, constexprs), constexprs=constexprs)
            kernel = triton.compile(source, target=target, options={**options, "launch_pdl": pdl})
            if pdl:
                _check_pdl_ptx(kernel.asm["ptx"])
        except Exception as exc:  # a compile error names the kernel line; report every case, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"ok   {name}: sm_{args.arch}, {warps} warps, {kernel.metadata.shared} B shared, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    print(f"compile_check: {failed} failed" if failed else "compile_check: all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
