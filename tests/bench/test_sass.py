"""bench/sass.py: the row-wise kernels' static SASS, compiled for sm_90 without a GPU. The counts docs/kernels.md quotes
are only meaningful if the compile gets a real launch's alignment hints (16-byte vector accesses) and the listing is
read right, so that is what these check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(*args: str, tmp_path: Path, interpret: bool = False) -> subprocess.CompletedProcess:
    """A fresh Python on this checkout (its own Triton cache; TRITON_INTERPRET only when asked)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _run(*args: str, tmp_path: Path, interpret: bool = False) -> subprocess.CompletedProcess:
    return _python("-m", "bench.sass", *args, tmp_path=tmp_path, interpret=interpret)


def _compiled(code: str, tmp_path: Path) -> str:
    """stdout of `code` run with bench.sass.compile_sass imported; fails the test on an error."""
    result = _python("-c", "from bench.sass import compile_sass\n" + code, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _count(line: str, what: str) -> int:
    return int(line.split(f" {what}")[0].rsplit(maxsplit=1)[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_op_gets_a_line_with_its_instructions_registers_and_no_spills(dtype, tmp_path):
    result = _run("--ops", "layer_norm", "layer_norm_gelu", "bias_gelu", "--dtypes", dtype, "--cols", "768",
                  "--block-m", "2", "--warps", "2", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == {"layer_norm", "layer_norm_gelu", "bias_gelu"}, result.stdout
    for op, line in lines.items():
        assert line.startswith(f"{dtype} 768 cols, BLOCK_M 2, 2 warps: "), line
        assert _count(line, "instructions per thread") > 100 and _count(line, "registers") > 0, line
        assert " 0 B stack" in line, f"{op} spills: {line}"
        assert ("MUFU" in line) == (op != "layer_norm"), line  # the erfc's reciprocal and exp2
    plain, gelu = (_count(lines[op], "instructions per thread") for op in ("layer_norm", "layer_norm_gelu"))
    assert gelu > plain + 2 * 24  # at least two instructions more for each of a thread's 24 elements


def test_the_compile_gets_a_launchs_alignment_hints(tmp_path):
    """Without them every load is a scalar 2-byte one and the count describes no kernel that runs."""
    out = _compiled("s = compile_sass('layer_norm', 'bfloat16', 768, 2, 2)\n"
                    "print(s.vector_loads, s.opcodes['LDG'], s.registers, s.instructions)\n", tmp_path)
    vector, loads, registers, instructions = map(int, out.split())
    # 2 rows x 768 bf16 on 64 threads: 24 elements of x a thread, three 16-byte vectors of 8, plus the weight and
    # bias of the three column blocks
    assert vector >= 3 and loads >= vector and 0 < registers <= 255 and instructions > 0


def test_only_the_half_gelu_kernel_hints_l2_eviction(tmp_path):
    """bf16 LayerNorm + GELU streams its input evict-first and keeps the weight and bias evict-last; the plain
    LayerNorm and the fp32 LayerNorm + GELU, where the hints did not pay, carry none (decision 0013)."""
    out = _compiled("for op, dtype in (('layer_norm_gelu', 'bfloat16'), ('layer_norm', 'bfloat16'),\n"
                    "                  ('layer_norm_gelu', 'float32')):\n"
                    "    s = compile_sass(op, dtype, 768, 2, 2)\n"
                    "    print(s.opcodes['LDG'], s.evict_first_loads, s.evict_last_loads)\n", tmp_path)
    (gelu_loads, gelu_first, gelu_last), (plain_loads, plain_first, plain_last), (f32_loads, f32_first, f32_last) = (
        tuple(map(int, line.split())) for line in out.splitlines())
    # 24 elements of x a thread in three 16-byte vectors; the weight and bias of the three column blocks
    assert gelu_first == 3 and gelu_last == 6 and gelu_loads == gelu_first + gelu_last
    assert plain_loads == gelu_loads and plain_first == plain_last == 0
    assert f32_loads > 0 and f32_first == f32_last == 0


def test_the_tool_refuses_the_interpreter(tmp_path):
    result = _run(tmp_path=tmp_path, interpret=True)
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stderr


def test_a_half_precision_result_takes_the_shorter_erfc(tmp_path):
    """The LayerNorm + GELU kernel passes HALF to its GELU when the output is fp16 or bf16: the three-term erfc, two
    FMAs fewer for each of a thread's 24 elements than the fp32 output's five-term one (the rest of the two kernels
    differs only in loads, stores and conversions, which are not FMAs)."""
    result = _run("--ops", "layer_norm_gelu", "--dtypes", "bfloat16", "float16", "float32", "--cols", "768",
                  "--block-m", "2", "--warps", "2", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ffma = {line.split()[1]: int(line.split(" FFMA ")[1].split(",")[0]) for line in result.stdout.splitlines()}
    assert ffma["bfloat16"] == ffma["float16"] and ffma["float32"] - ffma["bfloat16"] >= 2 * 24, ffma
