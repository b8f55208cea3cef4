"""Diagnose a Triton kernel cell: the host cost of one launch, the config the autotuner chose and its
timings, and the device time of every candidate config (CUDA-graph timed, L2 flushed).

    python -m bench.triton_configs add_layer_norm:bfloat16:16384x1024
    python -m bench.triton_configs linear_bias_gelu:float16:16x384x1536   # M x K x N: each GEMM config forced

For the GEMM + GELU kernel every candidate config is also launched on its own (linear_gelu.launch_config) and
timed the same way, next to the autotuner's own timings, so a pick that the device times disagree with shows.
"""

from __future__ import annotations

import sys
import time

import torch

from bench.kernels import DTYPES, _inputs, graph_ms, min_bytes
from kernels.triton import LAUNCHERS, _norm, _pointwise


def gemm(dtype_name: str, shape: str) -> None:
    from kernels.triton import linear_gelu as lg

    m, k, n = map(int, shape.split("x"))
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
    y = torch.empty(m, n, device="cuda", dtype=dtype)
    lg.linear_bias_gelu(x, weight, bias, out=y)  # autotunes this row class
    kernel = lg._linear_gelu_kernel
    picked_ms = graph_ms(lambda: lg.linear_bias_gelu(x, weight, bias, out=y))
    print(f"linear_bias_gelu {dtype_name} M={m} K={k} N={n} (row class {lg.row_class(m)}): autotuned "
          f"{picked_ms * 1e3:.1f} us with {kernel.best_config}")
    tuned = {str(c): t for c, t in getattr(kernel, "configs_timings", {}).items()}
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 0) or 48 * 1024
    for config in lg.configs_within(lg.CONFIGS, x.element_size(), limit):
        device_ms = graph_ms(lambda: lg.launch_config(config, x, weight, bias, y))
        print(f"   {device_ms * 1e3:7.1f} us forced; autotuner saw {tuned.get(str(config), '-')} for {config}")


def main(argv: list[str]) -> None:
    op, dtype_name, shape = argv
    if op == "linear_bias_gelu":
        gemm(dtype_name, shape)
        return
    rows, cols = map(int, shape.split("x"))
    dtype = DTYPES[dtype_name]
    inputs = _inputs(op, rows, cols, dtype, "cuda", seed=0)
    fn = LAUNCHERS[op]
    fn(*inputs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        fn(*inputs)
    host_us = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    kernel = _pointwise._bias_gelu_kernel if "gelu" in op and "layer_norm" not in op else _norm._norm_kernel
    nbytes = min_bytes(op, rows, cols, dtype)
    device_ms = graph_ms(lambda: fn(*inputs))
    print(f"{op} {dtype_name} {shape}: host {host_us:.1f} us/launch (queued, no sync); "
          f"device {device_ms * 1e3:.1f} us = {nbytes / device_ms / 1e6:.0f} GB/s; best {kernel.best_config}")
    for cfg, timing in sorted(getattr(kernel, "configs_timings", {}).items(), key=lambda kv: kv[1]):
        print(f"   autotune timing {timing} us-ish for {cfg}")


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        main(spec.split(":"))
