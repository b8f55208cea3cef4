"""Shared launcher plumbing for the Triton kernels: interpreter detection, the autotune decorator
(with a CPU benchmark under TRITON_INTERPRET=1), shape checks and the row view every launcher uses."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import json
import logging
import os
import statistics
import threading
import time

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels import timing
from fusedserve.kernels._layout import common_device, cpu_budget
# as_rows/as_vector/output_like/row_bucket are shared with the CUDA backend; re-exported for the launchers here.
from fusedserve.kernels._layout import MAX_COLS, as_rows, as_vector, output_like, row_bucket  # noqa: F401

log = logging.getLogger(__name__)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# FUSEDSERVE_TRITON_AUTOTUNE=0 skips benchmarking and takes each kernel's heuristic config (the first
# candidate): for test sweeps over many shapes, where every new shape would otherwise be tuned.
AUTOTUNE = os.environ.get("FUSEDSERVE_TRITON_AUTOTUNE", "1") != "0"


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Programmatic dependent launch (PDL, Hopper and later): on by default on sm_90+, FUSEDSERVE_TRITON_PDL=0 turns it
# off. Launched with it, a kernel's programs may be scheduled while the kernel before it in the stream is still
# finishing, so the gap between two dependent kernels shrinks: it counts most for a few-token batch, whose forward is
# a chain of short latency-bound kernels, and changes no output bit (the measurements are in bench/results).
# Safe only because every kernel launched with it runs `pdl_sync` before it reads or writes any activation: that waits
# for the previous kernel to complete with its writes visible (and that kernel, if it was launched with PDL too, had
# waited for its own predecessor, so every earlier kernel is complete as well). Kernels launched without it (cuBLAS,
# torch's) start after their predecessor completes, as always. Covered: the few-token layer's kernels (the LayerNorm
# kernel, qkv_attention / attention_partials, ffn_partials), the embedding + LayerNorm and segment_mean kernels.
_pdl = os.environ.get("FUSEDSERVE_TRITON_PDL", "1") != "0"


@contextlib.contextmanager
def pdl_launches(enabled: bool):
    """Programmatic dependent launch on or off for the launches inside (CUDA graphs captured inside keep it when
    replayed later); the previous setting comes back on exit."""
    global _pdl
    previous, _pdl = _pdl, bool(enabled)
    try:
        yield
    finally:
        _pdl = previous


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device | None = None) -> bool:
    """Whether launches on `device` (default: the current CUDA device) get PDL now: on, not the interpreter, sm_90+."""
    if not _pdl or INTERPRET:
        return False
    if device is None:
        if not torch.cuda.is_available():
            return False
        return _pdl_capable(torch.cuda.current_device())
    return device.type == "cuda" and _pdl_capable(device.index if device.index is not None
                                                  else torch.cuda.current_device())


def pdl_args(x: Tensor) -> dict:
    """Launch keywords for a kernel with a USE_PDL constexpr: PDL where it is on and x's device has it."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(x.device) else {"USE_PDL": False}


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """First thing in a kernel launched with PDL: wait until the previous kernel has completed and its writes are
    visible (griddepcontrol.wait), then let the next kernel's programs be scheduled (launch_dependents: they start
    once every program here has said so or exited, and wait in their own pdl_sync). Nothing without USE_PDL."""
    if USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


def _cpu_do_bench(fn, quantiles=None, reps: int = 1):
    """Autotuner benchmark for the interpreter: host wall time, so autotuning runs (cheaply) on CPU."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    return [median, min(times), max(times)] if quantiles else median


def autotune(configs: list[triton.Config], key: list[str], prune=None):
    """triton.autotune with our defaults. Under the interpreter the cost is per program, not per byte:
    keep the two surviving configs with the largest tiles and time them with a CPU benchmark, so the
    autotuning path itself runs in CI in seconds.

    The kernels pass their token counts (M, T, and the bucket that is only an autotune key) with
    `do_not_specialize`: Triton otherwise compiles a kernel apart for a count of 1, a multiple of 16 and any other
    count, which triples what a server's start compiles, and a count only bounds masks here (the vectorized
    accesses run along the columns, whose width stays specialized)."""

    jit = []  # the decorated kernel, once decorate has it

    def early_prune(configs, named_args, **kwargs):
        # called for a key the autotuner has not tuned (nor been seeded with), before it times the candidates
        kept = prune(configs, named_args, **kwargs) if prune else list(configs)
        kept = kept or list(configs)[:1]
        if INTERPRET:
            return sorted(kept, key=lambda c: -_tile(c, kwargs))[:2]
        if not AUTOTUNE:
            kept = kept[:1]
        if len(kept) > 1 or _current_pass() is not None:
            # Triton keys its kernel cache by the launching thread's current device, not the tensors'
            compile_ahead(jit[0], kept, list(named_args.values()), kwargs, torch.cuda.current_device())
        if _current_pass() is not None:
            raise _Untuned  # compile_only(): the candidates are compiling; the real launch times them
        return kept

    extra = {"do_bench": _cpu_do_bench} if INTERPRET else {"do_bench": timing.autotune_bench, **_AUTOTUNE_CACHE}

    def decorate(fn):
        jit.append(deferrable(fn))
        tuner = triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": early_prune},
                                **extra)(fn)
        run = tuner.run

        def run_or_skip(*args, **kwargs):
            try:
                return run(*args, **kwargs)
            except _Untuned:
                tuner.nargs = None  # run() sets it to this launch's arguments and clears it only when it returns
                return None

        tuner.run = run_or_skip  # kernel[grid](...) and the autotuner's callers reach run through the instance
        TUNERS[fn.fn.__name__] = tuner
        return tuner

    return decorate


# Threads that compile an untuned key's candidates side by side. The autotuner compiles each candidate as it first
# times it, one after another, and without shipped tuning a cold start would wait for those compiles in series. Triton's
# compiler releases the GIL through its MLIR passes and ptxas, so the candidates compile in parallel on a pool first
# and the autotuner then finds them compiled and only times them. At most 16, and no more than the CPUs this
# process may use (its affinity, and a container's CPU quota: each compile is a core's work and LLVM's memory).
COMPILE_THREADS = min(16, cpu_budget())
_compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
_compile_pool_lock = threading.Lock()
# the launch's own keywords, which the autotuner hands its pruning with the kernel's: warmup takes its own grid
_LAUNCH_KEYWORDS = ("grid", "warmup")


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _compile_pool
    with _compile_pool_lock:
        if _compile_pool is None:
            _compile_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                                  thread_name_prefix="triton-compile")
    return _compile_pool


def _compile(jit, args: list, kwargs: dict, device: int, what: object) -> None:
    """JITFunction.warmup on a pool thread: compiled and cached, not launched. A compile that fails here is left to
    the launch, which compiles it again and handles the failure as it always does."""
    try:
        with torch.cuda.device(device):  # a pool thread starts on device 0
            jit.warmup(*args, **kwargs)
    except Exception as exc:  # see the docstring
        log.debug("compile ahead of %s failed (its launch compiles it again): %s", what, exc)


def _specialization(value, specialized: bool = True) -> object:
    """What of a positional argument can make Triton compile a kernel apart, roughly (a tensor's dtype and 16-byte
    alignment, an int's 32/64-bit class and, unless the kernel takes it with do_not_specialize, its 1 / multiple of
    16 classes): launches alike here compile once in a compile pass. A class finer than Triton's costs a duplicate
    compile, a coarser one a compile left to the launch: never a wrong kernel, since every compile is Triton's own."""
    if isinstance(value, Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):  # a TMA descriptor: its type is the dtype and the block
        return value.base.dtype, tuple(value.block_shape)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return (int, -2**31 <= value < 2**31) + ((value == 1, value % 16 == 0) if specialized else ())
    if isinstance(value, float):
        return float
    return repr(value)


class _CompilePass:
    """compile_only()'s state on its thread: the compiles in flight, each submitted once."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []
        self.submitted: set = set()

    def submit(self, jit, args: list, kwargs: dict, device: int, what: object) -> None:
        fixed = [getattr(p, "do_not_specialize", False) for p in getattr(jit, "params", ())]
        specialized = [not (i < len(fixed) and fixed[i]) for i in range(len(args))]
        key = (id(jit), device, tuple(map(_specialization, args, specialized)),  # keywords: constexprs, options
               tuple(sorted((k, _specialization(v) if isinstance(v, Tensor) else repr(v))
                            for k, v in kwargs.items() if k != "grid")))
        if key not in self.submitted:
            self.submitted.add(key)
            _own_cache(jit, device)
            self.futures.append(_pool().submit(_compile, jit, args, kwargs, device, what))


def _own_cache(jit, device: int) -> None:
    caches = getattr(jit, "device_caches", None)
    if caches is not None:
        caches[device]  # noqa: B018 - made here, once: threads creating it together would each keep their own


def compile_ahead(jit, configs: list[triton.Config], args: list, kwargs: dict, device: int) -> None:
    """Compile `jit` for each config at these arguments for CUDA device `device`, in parallel; returns when all are
    done (inside compile_only(): at once, and that pass waits for them)."""
    if COMPILE_THREADS < 2 and _current_pass() is None:
        return  # nothing to gain: the autotuner compiles each as it times it
    kwargs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_KEYWORDS}
    compiles = _current_pass() or _CompilePass()
    for config in configs:
        compiles.submit(jit, args, {"grid": (1,), **kwargs, **config.all_kwargs()}, device, config)
    if compiles is not _current_pass():
        concurrent.futures.wait(compiles.futures)


_thread = threading.local()  # .compile_pass: the thread's compile-only pass, if it is inside one


def _current_pass() -> _CompilePass | None:
    return getattr(_thread, "compile_pass", None)


class _Untuned(Exception):
    """Inside compile_only(), an autotuned launch whose key has no config yet: its candidates are compiling and
    nothing runs (the autotuner times them at the real launch)."""


@contextlib.contextmanager
def compile_only():
    """Inside, on this thread, a launch of one of our Triton kernels runs nothing: it compiles what that launch would
    run on the compile pool (an autotuned key's chosen config, or all of an untuned key's candidates) and returns,
    its outputs left unwritten. On exit, waits for every compile. For a pass whose results are thrown away, ahead of
    the same launches for real: the start-up's shape sweep meets its kernels one after another, and compiling them
    serially on their first launches would make a start wait for each compile in turn. On one thread at a time per
    kernel: the autotuner keeps per-call state on itself."""
    if INTERPRET or _current_pass() is not None:
        yield
        return
    _thread.compile_pass = compiles = _CompilePass()
    try:
        yield
    finally:
        _thread.compile_pass = None
        concurrent.futures.wait(compiles.futures)


def deferrable(jit):
    """Make the launches of a @triton.jit kernel honour compile_only() (autotune does this for its kernels; a kernel
    launched directly takes it as a decorator above @triton.jit)."""
    run = jit.run

    def run_or_compile(*args, grid, warmup, **kwargs):
        compiles = _current_pass()
        if compiles is None or warmup:
            return run(*args, grid=grid, warmup=warmup, **kwargs)
        compiles.submit(jit, list(args), {"grid": grid, **kwargs}, torch.cuda.current_device(), jit.fn.__name__)
        return None

    jit.run = run_or_compile  # kernel[grid](...), warmup() and the autotuner all reach run through the instance
    return jit


# Every autotuned kernel by name: its chosen config per key is the Triton table of kernels.cache (saved beside
# the other tuning tables, shipped per GPU model, and seeded into the autotuners before they tune anything).
TUNERS: dict[str, triton.runtime.autotuner.Autotuner] = {}


def tuning_table() -> dict[str, dict[str, dict]]:
    """kernel -> autotune key (as JSON) -> the chosen config, for every key tuned or seeded in this process."""
    def entry(c: triton.Config) -> dict:
        return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
                "num_ctas": c.num_ctas, "maxnreg": c.maxnreg}

    return {name: {json.dumps(list(key)): entry(config) for key, config in tuner.cache.items()}
            for name, tuner in TUNERS.items() if tuner.cache}


def seed_tuning(table: dict) -> int:
    """Put a saved table's configs into the autotuners (keys they have not tuned yet): a seeded key runs its config
    without benchmarking or compiling the other candidates. Returns how many keys were seeded."""
    seeded = 0
    for name, entries in table.items():
        tuner = TUNERS.get(name)
        if tuner is None or not isinstance(entries, dict):
            continue  # a kernel that no longer exists
        for key, c in entries.items():
            try:
                config = triton.Config(c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                                       num_ctas=c.get("num_ctas", 1), maxnreg=c.get("maxnreg"))
                tuned_key = tuple(json.loads(key))
            except (KeyError, TypeError, ValueError):
                continue  # an entry written by another layout of the table: tuned again
            if tuned_key not in tuner.cache:
                tuner.cache[tuned_key] = config
                seeded += 1
    return seeded


# Autotune timings are kept on disk (Triton 3.4+: `cache_results`, in TRITON_CACHE_DIR beside the compiled kernels),
# so a restarted pod, the next replica on the node or the next test process takes each shape's tuned config instead
# of benchmarking its candidates again: with the compiled kernels already cached, choosing kernels (self-tests and
# races over shapes that each autotune) would otherwise dominate a server's start. The key holds the kernel's source,
# the GPU, Triton's version, the shape key and the candidate list, so any change re-tunes.
_AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _tile(config: triton.Config, kwargs: dict) -> int:
    meta = {**kwargs, **config.kwargs}
    return meta.get("BLOCK_M", 1) * meta.get("BLOCK_N", 1)


def check_device(name: str, *tensors: Tensor | None) -> None:
    device = common_device(name, tensors, SUPPORTED_DTYPES)
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def needs_wide(*matrices: Tensor | None) -> bool:
    """True if an element offset of any [rows, cols] matrix can reach 2^31 (then kernels use int64)."""
    return any(m is not None and m.numel() and (m.shape[0] - 1) * m.stride(0) + m.shape[1] >= 2**31
               for m in matrices)


def block_cols(cols: int) -> int:
    return triton.next_power_of_2(cols)
