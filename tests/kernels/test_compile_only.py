"""kernels/triton/_common.py, compile_only(): inside it a launch of our Triton kernels compiles what it would run on
the compile pool and runs nothing; an untuned autotune key compiles all its candidates and is left untuned; alike
launches compile once; on exit every compile is done. The compile itself needs a GPU's driver, so a stand-in kernel
(the JITFunction surface these paths use: run, warmup, device_caches, fn) records what it is asked to do."""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import threading

import pytest
import torch
import triton

from fusedserve import kernels
from fusedserve.kernels.triton import _common


class StandIn:
    """What the wrappers call of a JITFunction. `run(..., warmup=False)` is a launch, `warmup=True` a compile."""

    def __init__(self) -> None:
        self.launched: list[dict] = []
        self.compiled: list[tuple] = []
        self.device_caches = collections.defaultdict(dict)
        self.lock = threading.Lock()

        def kernel(X, N, BLOCK):  # the Python function behind it: the autotuner reads its name and arguments
            pass

        self.fn = kernel
        self.arg_names = ["X", "N", "BLOCK"]

    def run(self, *args, grid, warmup, **kwargs):
        with self.lock:
            if warmup:
                assert threading.current_thread().name.startswith("triton-compile"), "compiled off the pool"
                self.compiled.append((args, kwargs))
            else:
                self.launched.append({"args": args, **kwargs})

    def warmup(self, *args, grid, **kwargs):
        return self.run(*args, grid=grid, warmup=True, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The paths a CUDA launch takes, without one: not the interpreter, device 0, a pool of two."""
    monkeypatch.setattr(_common, "INTERPRET", False)
    monkeypatch.setattr(_common, "COMPILE_THREADS", 2)
    monkeypatch.setattr(_common, "_compile_pool", None)
    monkeypatch.setattr(_common, "TUNERS", {})  # the stand-in's autotuner stays out of the process's tuning table
    monkeypatch.setattr(_common.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_common.torch.cuda, "device", lambda d: contextlib.nullcontext())


def test_a_direct_launch_compiles_once_per_specialization_and_runs_nothing(on_a_gpu):
    kernel = _common.deferrable(StandIn())
    x = torch.randn(64)
    with _common.compile_only():
        for n in (17, 33, 49):  # one class (not 1, not a multiple of 16): one compile
            kernel[(1,)](x, n, BLOCK=64)
        kernel[(1,)](x, 32, BLOCK=64)  # a multiple of 16: Triton may specialize on it
        kernel[(1,)](x[1:], 17, BLOCK=64)  # a 4-byte aligned view: another specialization
        kernel[(1,)](x, 17, BLOCK=128)  # another constexpr
    assert kernel.launched == []
    assert len(kernel.compiled) == 4  # all done on exit
    assert {c[1]["BLOCK"] for c in kernel.compiled} == {64, 128}
    kernel[(1,)](x, 17, BLOCK=64)  # outside: a launch again
    assert len(kernel.launched) == 1 and kernel.launched[0]["BLOCK"] == 64


def test_an_autotuned_launch_compiles_its_config_or_all_candidates_and_tunes_nothing(on_a_gpu):
    stand_in = StandIn()
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 1), (128, 2), (256, 4))]
    tuner = _common.autotune(configs, key=["N"])(stand_in)
    tuned = tuner.cache[(32, "torch.float32")] = configs[1]  # as seeded from saved tuning
    x = torch.randn(64)
    with _common.compile_only():
        tuner[(1,)](x, 32)  # tuned: its config
        tuner[(1,)](x, 7)  # untuned: every candidate, and the key stays untuned for the real launch to time
        tuner[(1,)](x, 7)  # met again in the same pass: nothing new
    assert stand_in.launched == []
    compiled = sorted((c[1]["BLOCK"], c[1]["num_warps"], c[0][1]) for c in stand_in.compiled)
    assert compiled == [(64, 1, 7), (128, 2, 7), (128, 2, 32), (256, 4, 7)]
    assert list(tuner.cache) == [(32, "torch.float32")] and tuner.cache[(32, "torch.float32")] is tuned
    assert tuner.nargs is None  # the skipped launch's arguments are not held (its tensors would stay alive)
    tuner[(1,)](x, 32)  # outside: the tuned key runs its config
    assert [(launch["BLOCK"], launch["num_warps"]) for launch in stand_in.launched] == [(128, 2)]


def test_a_failed_compile_is_left_to_the_launch(on_a_gpu):
    class Failing(StandIn):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("out of resources")

    kernel = _common.deferrable(Failing())
    with _common.compile_only():
        kernel[(1,)](torch.randn(8), 3, BLOCK=8)
    assert kernel.launched == []
    kernel[(1,)](torch.randn(8), 3, BLOCK=8)
    assert len(kernel.launched) == 1


def test_the_interpreter_runs_every_launch(monkeypatch):
    monkeypatch.setattr(_common, "INTERPRET", True)
    kernel = _common.deferrable(StandIn())
    with _common.compile_only():
        kernel[(1,)](torch.randn(8), 3, BLOCK=8)
    assert len(kernel.launched) == 1 and kernel.compiled == []


def test_a_count_the_kernel_does_not_specialize_on_compiles_once_for_every_value(on_a_gpu):
    """do_not_specialize=["M"]: Triton compiles one variant for every 32-bit M, so the pass submits one compile."""
    class Param:
        def __init__(self, fixed: bool) -> None:
            self.do_not_specialize = fixed

    stand_in = StandIn()
    stand_in.params = [Param(False), Param(True), Param(False)]  # X, N (not specialized here), BLOCK
    kernel = _common.deferrable(stand_in)
    x = torch.randn(64)
    with _common.compile_only():
        for n in (1, 7, 16, 33, 2**20):
            kernel[(1,)](x, n, BLOCK=64)
        kernel[(1,)](x, 2**40, BLOCK=64)  # a 64-bit count: another signature
    assert sorted(c[0][1] for c in kernel.compiled) == [1, 2**40]


def test_watch_compiles_reports_each_compile_until_stopped():
    """kernels.watch_compiles installs a Triton post-compile hook (the server's log line for a kernel compiled after
    ready) that passes on the kernel's description, calls the hook that was there before, never raises into the
    launch, and on None puts the earlier hook back."""
    knobs = pytest.importorskip("triton.knobs")
    seen: list[str] = []
    earlier: list[dict] = []
    before = knobs.runtime.jit_post_compile_hook
    call = {"key": None, "repr": "_norm_kernel[num_warps=4](X: *fp16)", "fn": None, "compile": {},
            "is_manual_warmup": False, "already_compiled": False}
    try:
        knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw) or False
        assert kernels.watch_compiles(seen.append)
        assert kernels.watch_compiles(seen.append)  # again (a second service in the process): still one hook
        assert knobs.runtime.jit_post_compile_hook(**call) is False
        assert seen == [call["repr"]] and earlier == [call]
        assert kernels.watch_compiles(lambda kernel: 1 / 0)
        assert knobs.runtime.jit_post_compile_hook(**call) is False  # the watcher's error is logged, not raised
        assert len(earlier) == 2
        assert kernels.watch_compiles(None)
        knobs.runtime.jit_post_compile_hook(**call)
        assert len(earlier) == 3 and seen == [call["repr"]]  # the earlier hook alone again
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_watch_autotunes_reports_each_candidate_timed_until_stopped():
    """kernels.watch_autotunes wraps our autotuners' benchmark (the server's log line for a key tuned after ready):
    an untuned key's launch reports its kernel per candidate timed, a tuned key's launch nothing; a failing callback
    is logged, not raised; None puts the autotuner's own benchmark back."""
    from fusedserve.kernels.triton import LAUNCHERS, _common

    tuner = _common.TUNERS["_norm_kernel"]
    own = tuner.do_bench
    seen: list[str] = []

    def launch(cols: int) -> None:
        x, w, b = torch.randn(5, cols), torch.randn(cols), torch.randn(cols)
        LAUNCHERS["layer_norm"](x, w, b, 1e-5)

    try:
        assert kernels.watch_autotunes(seen.append)
        assert kernels.watch_autotunes(seen.append)  # again (a second service in the process): one wrapper
        launch(52)  # a width no other test tunes: a new key
        assert seen and set(seen) == {"_norm_kernel"} and len(seen) <= len(tuner.configs)
        count = len(seen)
        launch(52)  # tuned now: the launch times nothing
        assert len(seen) == count
        assert kernels.watch_autotunes(lambda kernel: 1 / 0)
        launch(53)  # the watcher's error is logged; the launch tunes and runs
    finally:
        assert kernels.watch_autotunes(None)
    assert tuner.do_bench is own and not kernels._own_benches  # the autotuners' own benchmarks back, none held
    launch(54)
    assert len(seen) == count


def test_the_backend_queries_load_no_backend_and_answer_for_the_loaded_one(monkeypatch):
    """kernels.pdl_enabled and kernels.cuda_launch_configs (what the model reports): in a process that loaded neither
    fused backend they answer False and {} and load nothing; once loaded, the backend's own answer."""
    code = ("import sys; from fusedserve import kernels; "
            "print(kernels.pdl_enabled('cuda'), kernels.cuda_launch_configs(), "
            "[m for m in ('triton', 'fusedserve.kernels.triton._common', 'fusedserve.kernels.cuda.tuning') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False {} []"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernels.pdl_enabled(device) is _common.pdl_enabled(device)
    with _common.pdl_launches(False):
        assert kernels.pdl_enabled(device) is False
    from fusedserve.kernels.cuda import tuning

    tuner = tuning.Tuner()
    tuner._table["norm|float16|384|13"] = {"config": [128, 256], "us": 1.0, "heuristic_us": 2.0, "candidates": 2}
    monkeypatch.setattr(tuning, "TUNER", tuner)
    assert kernels.cuda_launch_configs() == tuner.table() and kernels.cuda_launch_configs() is not tuner._table
