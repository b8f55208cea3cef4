"""The FFN-in of an encoder layer, GELU(x @ W^T + b), several ways on the same inputs in one run: our Triton GEMM
with the bias + GELU epilogue (pointer loads, and the persistent TMA variant); cuBLAS (F.linear) followed by our
separate bias_gelu (CUDA and Triton: what the encoder runs today); eager PyTorch; torch.compile of the same; and
cuBLASLt's own GELU epilogue (`torch._addmm_activation`, the tanh approximation: a speed reference, not the same
math).

    python -m bench.linear_gelu --out bench/results/$(date +%F)-h200-linear-gelu.json

`--op linear_add_layer_norm` measures the attention-out / FFN-out block instead, LayerNorm(x @ W^T + b + residual):
our Triton split kernel (GEMM + LayerNorm epilogue, one launch; forced at every row count here), the Triton
backend's op as the model calls it (the split kernel up to SMALL_ROWS rows, cuBLAS + add_layer_norm above), cuBLAS
+ the CUDA or Triton add_layer_norm, eager PyTorch and torch.compile.

Device time per call (the call captured in a CUDA graph, L2 flushed before each replay, median), TFLOP/s of
the GEMM (2 M N K / time), and each provider's error against the float64 reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import command, save
from bench.kernels import graph_ms

SHAPES = {  # name: (M tokens, K hidden, N intermediate)
    "bert-base b32 s128": (4096, 768, 3072),
    "bert-base b128 varlen (9216-token bucket)": (9216, 768, 3072),
    "minilm-l6 b32 s128": (4096, 384, 1536),
    "minilm-l6 b1 s16": (16, 384, 1536),
    "bert-base b1 s16": (16, 768, 3072),
}


LN_SHAPES = {  # name: (M tokens, K in, N hidden)
    "minilm-l6 attn-out b1 s16": (16, 384, 384),
    "minilm-l6 ffn-out b1 s16": (16, 1536, 384),
    "minilm-l6 ffn-out 64 tokens": (64, 1536, 384),
    "minilm-l6 ffn-out 128 tokens": (128, 1536, 384),
    "minilm-l6 ffn-out 512 tokens": (512, 1536, 384),
    "minilm-l6 ffn-out b32 s128": (4096, 1536, 384),
    "bert-base attn-out b1 s16": (16, 768, 768),
    "bert-base ffn-out b1 s16": (16, 3072, 768),
}


def ln_providers() -> dict[str, Callable]:
    """linear_add_layer_norm: the split kernel, each backend's op, and what a user would write instead."""
    from kernels.triton import LAUNCHERS as TRITON
    from kernels.triton.linear_layer_norm import linear_add_layer_norm

    out: dict[str, Callable] = {
        "triton split GEMM+LN (one kernel)": lambda *a: linear_add_layer_norm(*a, small_rows=1 << 30),
        "triton backend op": TRITON["linear_add_layer_norm"]}
    try:
        from kernels.cuda import load

        out["cuBLAS + cuda add_layer_norm"] = load()["linear_add_layer_norm"]
    except Exception as exc:
        print(f"cuda backend unavailable: {exc}", file=sys.stderr)
    out["cuBLAS + triton add_layer_norm"] = lambda x, w, b, r, g, beta, eps: TRITON["add_layer_norm"](
        F.linear(x, w), r, b, g, beta, eps)

    def eager(x, w, b, r, g, beta, eps):
        return F.layer_norm(F.linear(x, w, b) + r, (w.shape[0],), g, beta, eps)

    out["eager F.layer_norm(F.linear + residual)"] = eager
    out["torch.compile"] = torch.compile(eager, dynamic=False)
    return out


def _gelu_inputs(m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to("cuda", dtype)
    return x, w, b


def _ln_inputs(m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    x, w, b = _gelu_inputs(m, k, n, dtype, gen)  # drawn first: the same x, w, b as the GELU op's at a shape
    r = torch.randn(m, n, generator=gen).to("cuda", dtype)
    g = (torch.randn(n, generator=gen) * 0.5 + 1).to("cuda", dtype)
    beta = (torch.randn(n, generator=gen) * 0.5).to("cuda", dtype)
    return x, w, b, r, g, beta, 1e-12


def run(args: argparse.Namespace) -> dict:
    """Every provider of args.op on every shape: device time, TFLOP/s of the GEMM, error against float64."""
    from kernels import reference
    from kernels.testing import compare

    table, make_inputs, make_providers = OPS[args.op]
    impls = make_providers()
    dtype = getattr(torch, args.dtype)
    results = []
    for name in args.shapes:
        m, k, n = table[name]
        inputs = make_inputs(m, k, n, dtype, torch.Generator().manual_seed(0))
        exact = [t.double().cpu() if isinstance(t, torch.Tensor) else t for t in inputs]
        ref = getattr(reference, args.op)(*exact)
        flops = 2 * m * n * k
        print(f"{name}: M={m} K={k} N={n} {args.dtype}", file=sys.stderr, flush=True)
        for provider, fn in impls.items():
            started = time.perf_counter()
            got = fn(*inputs)  # warm-up: compile / autotune outside the timing
            torch.cuda.synchronize()
            error = compare(got, ref, dtype)
            ms = graph_ms(lambda: fn(*inputs))
            results.append({"op": args.op, "shape": name, "m": m, "k": k, "n": n, "dtype": args.dtype,
                            "provider": provider, "ms": ms, "tflops": flops / ms / 1e9, "rel_l2": error.rel_l2,
                            "max_abs": error.max_abs, "within_tolerance": error.ok,
                            "first_call_s": time.perf_counter() - started})
            print(f"  {provider:40s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  {error}",
                  file=sys.stderr, flush=True)
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "results": results}


def providers() -> dict[str, Callable]:
    """The two backends' linear_bias_gelu (what the registry races), then what a user would write instead."""
    from kernels.triton import LAUNCHERS as TRITON

    from kernels.triton.linear_gelu import linear_bias_gelu_tma

    out: dict[str, Callable] = {"triton fused GEMM+bias+GELU": TRITON["linear_bias_gelu"],
                                "triton TMA persistent GEMM+bias+GELU": linear_bias_gelu_tma}
    try:
        from kernels.cuda import load

        out["cuBLAS + cuda bias_gelu"] = load()["linear_bias_gelu"]
    except Exception as exc:  # the extension does not build here: say so, measure the rest
        print(f"cuda backend unavailable: {exc}", file=sys.stderr)
    out["cuBLAS + triton bias_gelu"] = lambda x, w, b: TRITON["bias_gelu"](F.linear(x, w), b)
    out["eager F.gelu(F.linear)"] = lambda x, w, b: F.gelu(F.linear(x, w, b))
    out["torch.compile"] = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    out["cuBLASLt tanh epilogue"] = lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return out


# op: (its shapes, its inputs at a shape, its providers)
OPS = {"linear_bias_gelu": (SHAPES, _gelu_inputs, providers),
       "linear_add_layer_norm": (LN_SHAPES, _ln_inputs, ln_providers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.linear_gelu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="linear_bias_gelu", choices=list(OPS))
    parser.add_argument("--shapes", nargs="+", choices=[*SHAPES, *LN_SHAPES],
                        help="default: every shape of the op")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.linear_gelu needs a CUDA GPU", file=sys.stderr)
        return 2
    table = OPS[args.op][0]
    args.shapes = args.shapes or list(table)
    wrong = [s for s in args.shapes if s not in table]
    if wrong:
        parser.error(f"shapes {wrong} are not shapes of {args.op}")
    report = run(args) | {"command": command("linear_gelu", argv)}
    save(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
