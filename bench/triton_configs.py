"""Diagnose a Triton kernel cell: the host cost of one launch, the config the autotuner chose and its
timings, and the device time of every candidate config (CUDA-graph timed, L2 flushed).

    python -m bench.triton_configs add_layer_norm bfloat16 16384x1024
"""

from __future__ import annotations

import sys
import time

import torch

from bench.kernels import DTYPES, _inputs, graph_ms, min_bytes
from kernels.triton import LAUNCHERS, _norm, _pointwise


def main(argv: list[str]) -> None:
    op, dtype_name, shape = argv
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
