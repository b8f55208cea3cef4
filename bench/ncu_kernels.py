"""One fused op at one shape, for Nsight Compute: warm up (autotuning, launch-config sweeps) outside the
profiled range, then run the op once inside an NVTX range named "profile".

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats python -m bench.ncu_kernels triton layer_norm_gelu bfloat16 32768x768
"""

from __future__ import annotations

import sys

import torch

from bench.kernels import _inputs
from model.runner import DTYPES


def main(argv: list[str]) -> int:
    provider, op, dtype, shape = argv
    rows, cols = map(int, shape.split("x"))
    if provider == "triton":
        from kernels.triton import LAUNCHERS
    else:
        from kernels import cuda

        LAUNCHERS = cuda.load()
    fn = LAUNCHERS[op]
    args = _inputs(op, rows, cols, DTYPES[dtype], "cuda", seed=1)
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("profile"):
        fn(*args)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
