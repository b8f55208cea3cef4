"""An untuned key's autotune candidates are compiled side by side before the autotuner times them
(kernels/triton/_common.py, compile_ahead). The compile itself needs a GPU's driver; here a stand-in kernel records
what it is asked to compile and proves two compiles run at once."""

from __future__ import annotations

import collections
import contextlib
import threading

import torch
import triton

from fusedserve.kernels.triton import _common


def test_candidates_compile_in_parallel_and_a_failure_is_left_to_the_autotuner(monkeypatch):
    monkeypatch.setattr(_common, "COMPILE_THREADS", 2)
    monkeypatch.setattr(_common, "_compile_pool", None)
    devices = []
    monkeypatch.setattr(_common.torch.cuda, "device", lambda d: devices.append(d) or contextlib.nullcontext())
    both_at_once = threading.Barrier(2, timeout=30)
    calls = []

    class Kernel:
        device_caches = collections.defaultdict(list)  # made once, before the threads

        def warmup(self, *args, grid, **kwargs):
            assert list(self.device_caches) == [1]
            calls.append((args, grid, kwargs))
            if kwargs["BLOCK_M"] == 4:
                raise RuntimeError("out of resources")
            both_at_once.wait()  # raises BrokenBarrierError, recorded below, unless the other compile runs meanwhile
            passed.append(kwargs["BLOCK_M"])

    passed = []
    configs = [triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in ((1, 1), (2, 2), (4, 4))]
    x = torch.randn(3, 8)
    # what the autotuner hands its pruning: the kernel's keywords and the launch's own (grid, warmup), which warmup
    # must not get twice
    launch = {"N_CHUNK": 1, "launch_pdl": True, "grid": lambda meta: (1,), "warmup": False}
    _common.compile_ahead(Kernel(), configs, [x, 3, 8], launch, 1)
    assert sorted(passed) == [1, 2]  # both met at the barrier: compiled side by side
    assert len(calls) == 3 and devices == [1] * 3
    for args, grid, kwargs in calls:
        assert args[0] is x and args[1:] == (3, 8) and grid == (1,) and "warmup" not in kwargs
        assert kwargs["N_CHUNK"] == 1 and kwargs["launch_pdl"] is True and kwargs["num_warps"] == kwargs["BLOCK_M"]


def test_nothing_is_compiled_ahead_with_one_thread(monkeypatch):
    monkeypatch.setattr(_common, "COMPILE_THREADS", 1)

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            raise AssertionError("compiled ahead with one thread")

    configs = [triton.Config({"BLOCK_M": m}) for m in (1, 2)]
    _common.compile_ahead(Kernel(), configs, [torch.randn(2)], {}, 0)
