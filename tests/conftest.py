"""What every test shares: the device this machine has, the one gate for GPU-only tests, the one way a missing
outside tool is reported, and the shapes the kernel sweeps cover.

- `device` (a fixture): "cuda" on a machine with a CUDA GPU, else "cpu", where Triton runs on its interpreter. A test
  that takes it runs once, on whichever this machine has; nothing is parametrized over devices it lacks.
- `@pytest.mark.gpu`: the test can only run on a GPU. Without CUDA such tests are deselected, not skipped (the
  terminal summary says how many and why), so a CPU run reports only real skips. On a GPU machine the tests that
  take `device` are marked `gpu` too, so `pytest -m gpu` runs them there as well.
- `require_tool`: a missing outside tool (nvcc, promtool, kubectl, ...) is a skip with its reason, and a failure
  where CI has installed it and says so (FUSEDSERVE_REQUIRE_*=1).
- Tolerances: the kernel table is kernels.testing.TOLERANCES (the registry's self-test uses the same one), re-exported
  here; the embedding table, for model and server tests, is tests/tolerances.py.
- Waiting: tests/waiting.py polls for the state a test needs within a deadline, instead of a fixed sleep that a
  loaded machine outlasts.
- `@pytest.mark.slow`: the slowest tests (nvcc builds, multi-process scenarios, real checkpoints, whole-server
  bursts), tens of seconds each; `pytest -m "not slow"` is the fast subset.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch


HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Without a GPU the Triton kernels run on the interpreter; it must be switched on before triton is imported.
INTERPRETER = not HAS_CUDA
if INTERPRETER:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fusedserve.kernels.testing import TOLERANCES  # noqa: E402,F401  (the kernel tolerance table)


def _threads_per_worker() -> None:
    """`pytest -n N` runs N processes on the machine's cores, so each computes on its share of them. Left alone, torch
    and numpy's OpenBLAS each start a thread per core in every process, and the oversubscribed (spin-waiting) pools
    make the CPU-bound interpreter sweeps far slower. Servers and compilers the tests start keep their defaults."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # comes with scikit-learn (the reference extra); without it numpy keeps its default
        return
    threadpool_limits(threads)


_threads_per_worker()

# Odd widths on purpose: a single column, sub-warp, non-power-of-two, just over / under a power of two.
ODD_COLS = (1, 7, 300, 769, 1023, 4097)
ROWS = (1, 333)
# On the interpreter every program runs as numpy, so a case costs rows x columns: at the widest column count the
# second row count is one that still leaves a ragged row block (BLOCK_M 32-256 tiles 45 rows with a tail; the
# tails after several blocks are covered by the narrower columns at 333 rows). On a GPU every case runs at ROWS.
WIDE_COLS, WIDE_ROWS_ON_THE_INTERPRETER = 4097, 45
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def shapes() -> list[tuple[int, int]]:
    """(rows, cols) of the kernel sweeps: ROWS x ODD_COLS (see WIDE_ROWS_ON_THE_INTERPRETER)."""
    return [(WIDE_ROWS_ON_THE_INTERPRETER if INTERPRETER and cols >= WIDE_COLS and rows > 1 else rows, cols)
            for rows in ROWS for cols in ODD_COLS]

NO_GPU = "needs a CUDA GPU and this machine has none (run them on a GPU machine with `pytest -m gpu`)"


@pytest.fixture
def device() -> str:
    """The device this machine has: "cuda", or "cpu" (the Triton interpreter)."""
    return DEVICE


def require_tool(name: str, required_by: str, path: str | None = None) -> str:
    """The path of an outside tool (looked up on PATH and beside this Python unless `path` is given). Missing: a skip
    with the reason, or a failure where the environment variable `required_by` is 1 (CI installs the tool and sets
    it, so there the test must run)."""
    if path is None:
        path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path:
        return path
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{name} is required here ({required_by}=1) but not installed")
    pytest.skip(f"{name} not installed")


_GPU_COUNT = pytest.StashKey[int]()  # how many gpu tests this run deselected
_GPU_DESELECTED = "fusedserve_gpu_deselected"  # the same count, sent by an xdist worker to the controller


@pytest.hookimpl(tryfirst=True)  # before -m: on a GPU, `-m gpu` must see the marks added here
def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        for item in items:
            if "device" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.gpu)
        return
    gpu_only = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_only:
        return
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    config.hook.pytest_deselected(items=gpu_only)
    config.stash[_GPU_COUNT] = len(gpu_only)
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the summary
        config.workeroutput[_GPU_DESELECTED] = len(gpu_only)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller collects nothing itself: it takes the count from a worker (each collects every test)."""
    count = getattr(node, "workeroutput", {}).get(_GPU_DESELECTED)
    if count is not None:
        node.config.stash[_GPU_COUNT] = max(count, node.config.stash.get(_GPU_COUNT, 0))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.stash.get(_GPU_COUNT, 0)
    if count and not hasattr(config, "workeroutput"):
        terminalreporter.write_line(f"{count} tests marked gpu deselected: {NO_GPU}")
