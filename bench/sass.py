"""Static SASS of the row-wise Triton kernels, compiled for a GPU architecture on a machine without one:
`python -m bench.sass`.

For each op, dtype, width and launch configuration: the instructions of one program (every kernel here is straight-
line code, so this is what each thread issues), by opcode, with the registers and the stack (spills) ptxas gave it.
The numbers of instructions per thread in docs/kernels.md come from here. Nsight Compute measures what they cost on the
GPU (`python -m bench.nsight`); this says where they come from, in seconds and without a device.

The compile gets the hints a real launch gives Triton: every pointer, row stride and the width divisible by 16. Without
them the loads and stores come out as scalar 2- or 4-byte accesses and the count describes no kernel that runs.
Must run without TRITON_INTERPRET (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

OPS = ("layer_norm", "layer_norm_gelu", "add_layer_norm", "embedding_layer_norm", "bias_gelu", "bias_residual_gelu")
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# an opcode's first word: "LDG.E.128 R4, ..." -> LDG; a predicate guard (@P0, @!UP1) before it is skipped
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


@dataclass(frozen=True)
class Sass:
    op: str
    dtype: str
    cols: int
    block_m: int
    warps: int
    opcodes: collections.Counter  # opcode -> instructions
    vector_loads: int  # 16-byte global loads (LDG.E.128)
    evict_first_loads: int  # global loads with an L2 evict-first hint (LDG.E.EF)
    evict_last_loads: int  # and with evict-last (LDG.E.EL)
    registers: int
    stack_bytes: int

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    def line(self, top: int = 12) -> str:
        common = ", ".join(f"{name} {n}" for name, n in self.opcodes.most_common(top))
        return (f"{self.op} {self.dtype} {self.cols} cols, BLOCK_M {self.block_m}, {self.warps} warps: "
                f"{self.instructions} instructions per thread, {self.registers} registers, {self.stack_bytes} B stack; "
                f"{common}; global loads: {self.vector_loads} of 16 bytes, {self.evict_first_loads} evict-first, "
                f"{self.evict_last_loads} evict-last")


def _case(op: str, dtype: str, cols: int, block_m: int):
    """(jit function, signature, constexprs) of `op`'s kernel as its launcher would specialize it; the argument types
    are the compile check's (kernels.triton.compile_check)."""
    from fusedserve.kernels.triton.compile_check import _norm_case, _signature

    ptr = "*" + DTYPES[dtype]
    if op in ("bias_gelu", "bias_residual_gelu"):
        from fusedserve.kernels.triton._pointwise import _bias_gelu_kernel, column_block

        block_n = column_block(cols)
        types = {"X": ptr, "BIAS": ptr, "R": ptr, "Y": ptr, "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
                 "M": "i32", "N": "i32", "M_BUCKET": "i32"}
        constexprs = {"HAS_RESIDUAL": op == "bias_residual_gelu", "GELU": 1, "F64": False, "WIDE": False,
                      "BLOCK_N": block_n, "EVEN_N": cols % block_n == 0, "BLOCK_M": block_m}
        fn = _bias_gelu_kernel.fn
    else:
        from fusedserve.kernels.triton._norm import _norm_kernel, column_chunks

        nchunk, chunk = column_chunks(cols)
        gather = op == "embedding_layer_norm"
        types, constexprs = _norm_case(ptr, SOURCES=3 if gather else 2 if op == "add_layer_norm" else 1,
                                       GATHER=gather, GELU=1 if op == "layer_norm_gelu" else 0, NCHUNK=nchunk,
                                       CHUNK=chunk, EVEN_COLS=nchunk * chunk == cols, BLOCK_M=block_m)
        fn = _norm_kernel.fn
    return fn, _signature(fn, types, constexprs), constexprs


def compile_sass(op: str, dtype: str, cols: int, block_m: int, warps: int, arch: int = 90) -> Sass:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constexprs = _case(op, dtype, cols, block_m)
    aligned = [i for i, name in enumerate(fn.arg_names)
               if signature[name].startswith("*") or name.startswith("stride") or (name == "N" and cols % 16 == 0)]
    source = ASTSource(fn, signature, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    cuobjdump = knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        listing = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    opcodes, vector_loads, evict_first, evict_last = collections.Counter(), 0, 0, 0
    for row in listing.splitlines():
        match = _INSTRUCTION.match(row)
        if match:
            opcodes[match.group(1)] += 1
            if match.group(1) == "LDG":
                modifiers = match.group(2).split(".")
                vector_loads += modifiers[-1] == "128"
                evict_first += "EF" in modifiers
                evict_last += "EL" in modifiers
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return Sass(op, dtype, cols, block_m, warps, opcodes, vector_loads, evict_first, evict_last, registers, stack)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=["layer_norm", "layer_norm_gelu"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bfloat16"])
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--block-m", type=int, default=2, help="rows per program")
    parser.add_argument("--warps", type=int, default=2)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: Hopper)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench.sass: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)", file=sys.stderr)
        return 2
    for op in args.ops:
        for dtype in args.dtypes:
            print(compile_sass(op, dtype, args.cols, args.block_m, args.warps, args.arch).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
