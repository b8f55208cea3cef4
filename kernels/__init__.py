"""Fused transformer ops with interchangeable backends (Triton, CUDA, torch reference).

`select(...)` decides, per op, which backend runs it and returns an immutable `Selection`; the ops below run the
implementations of the selection installed by `use(selection)` in the current context (thread or task), and the
torch reference outside any. The owner of a model keeps its selection and installs it around each forward, so two
threads (the serving worker and a background reference check) run different paths without sharing a table.

A `contextvars.ContextVar` rather than a thread-local: it is per thread as well, and also per asyncio task, and
`use()` restores the outer value on exit however the block ends. torch.compile reads it once, when it traces: a
compiled module keeps the backends that were selected then (call torch._dynamo.reset() to trace a new selection).
"""

from __future__ import annotations

if __name__ != "fusedserve.kernels":  # the checkout's root on sys.path: an installed `kernels` is meant
    from fusedserve.shadowing import give_way

    give_way(__name__, __file__)
else:  # the package, as fusedserve.kernels (docs/decisions/0015)
    import contextlib
    import contextvars
    import importlib.util
    import logging
    import os
    import sys
    from collections.abc import Callable, Iterator

    import torch

    from fusedserve.kernels import library, registry
    from fusedserve.kernels.library import signature
    from fusedserve.kernels.registry import (REFERENCE, REFERENCE_BACKEND, BackendError, BackendUnavailable, Selection,
                                             reference_selection, select)
    from fusedserve.kernels.spec import OP_SPECS, OPS, REFERENCE_OPS

    log = logging.getLogger("fusedserve.kernels")

    # An observer gets every op call: (op, backend, implementation, args, kwargs) -> the call's result.
    Observer = Callable[[str, str, Callable, tuple, dict], object]

    _active: contextvars.ContextVar[tuple[Selection, Observer | None]] = contextvars.ContextVar(
        "fusedserve_kernels", default=(REFERENCE, None))


    @contextlib.contextmanager
    def use(selection: Selection, observer: Observer | None = None) -> Iterator[Selection]:
        """Run kernels.<op> on `selection` inside the block (this thread or task only); with `observer`, every op
        call goes through it (kernels.timing.OpTimer.call times them)."""
        token = _active.set((selection, observer))
        try:
            yield selection
        finally:
            _active.reset(token)


    def current() -> Selection:
        """The selection kernels.<op> runs on here and now."""
        return _active.get()[0]


    def _traced_backend(op: str) -> str:
        """The backend of `op` in the current selection, a constant to torch.compile: Dynamo (torch 2.11) cannot trace
        ContextVar.get, and a string is the one result every version keeps as a constant."""
        return _active.get()[0].choices[op].backend


    # What torch.compiler.assume_constant_result does, without the import of torch._dynamo it starts with: importing
    # the kernels must not pay for Dynamo, which only the torch.compile path uses (tests/kernels/test_compile_marker.py
    # checks that the mark is still the decorator's and that importing the kernels leaves Dynamo unimported).
    _traced_backend._dynamo_marked_constant = True  # type: ignore[attr-defined]


    def _public(op: str) -> Callable:
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():  # the backend's own op (its torch.library node), never an observer
                backend = _traced_backend(op)
                impl = REFERENCE_OPS[op] if backend == REFERENCE_BACKEND else library.loaded(backend)[op]
                return impl(*args, **kwargs)
            selection, observer = _active.get()
            if observer is None:
                return selection.impls[op](*args, **kwargs)
            return observer(op, selection.choices[op].backend, selection.impls[op], args, kwargs)

        call.__name__ = call.__qualname__ = op
        call.__doc__ = OP_SPECS[op].doc
        call.__signature__ = signature(OP_SPECS[op])
        call.__module__ = __name__
        return call


    # one public callable per op of kernels.spec, the one op list: `from fusedserve.kernels import layer_norm`
    globals().update({op: _public(op) for op in OPS})

    __all__ = ["OPS", "REFERENCE", "BackendError", "Observer", "Selection", "compile_only", "configure",
               "cuda_launch_configs", "current", "pdl_enabled", "reference_selection", "registry", "save_tuning",
               "select", "use", "watch_autotunes", "watch_compiles", *OPS]


    def configure(*, cache_dir: str | None = None) -> None:
        """The kernel layer's settings, given by whoever owns them (the model layer passes the service's).

        cache_dir: where compiled and tuned kernels, the CUDA launch tuning and the backend races are kept for the next
        start (kernels.cache); None or empty: FUSEDSERVE_CACHE_DIR, else ~/.cache/fusedserve (standalone use).

        Call it before the first select(). A later call applies to what is read and saved from then on (tuning tables,
        races, Triton's cache when the kernel layer had chosen its directory), but what this process already loaded
        stays as it was loaded: the Triton kernels compiled so far, the CUDA extension and the CUDA launch-configuration
        table once read."""
        from fusedserve.kernels import cache

        cache.configure(cache_dir)


    def _load_triton(device: torch.device):
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailable("the triton package is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailable(f"needs a CUDA device, got {device} (TRITON_INTERPRET=1 runs it on the CPU, for "
                                     "tests)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("CUDA is not available")
        from fusedserve.kernels import cache
        from fusedserve.kernels.triton import LAUNCHERS

        cache.use_for_triton()
        if device.type == "cuda":
            cache.seed_triton(device)
        return library.custom_ops("triton", LAUNCHERS)


    def watch_compiles(callback: Callable[[str], None] | None) -> bool:
        """From now on, callback(description) after every Triton kernel this process compiles or loads from Triton's
        cache (a kernel's first launch at a new specialization); None stops it. False, and nothing installed, where our
        Triton kernels are not loaded or this Triton has no hook for it. The server watches after ready, where no batch
        should wait for either. A hook installed before is still called; the callback's errors are logged, never raised
        into the launch that compiled."""
        global _watched
        if "fusedserve.kernels.triton._common" not in sys.modules:
            return False
        from triton import knobs

        if not hasattr(getattr(knobs, "runtime", None), "jit_post_compile_hook"):
            return False
        if callback is None:
            if _watched is not None:
                knobs.runtime.jit_post_compile_hook, _watched = _watched[0], None
            return True
        previous = _watched[0] if _watched is not None else knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            try:
                callback(str(kwargs.get("repr", "a Triton kernel")))
            except Exception:
                log.exception("the compile watcher failed")
            return previous(*args, **kwargs) if previous is not None else False

        knobs.runtime.jit_post_compile_hook = hook
        _watched = (previous,)
        return True


    _watched: tuple[Callable | None] | None = None  # while watch_compiles is on: the hook it found installed


    def watch_autotunes(callback: Callable[[str], None] | None) -> bool:
        """From now on, callback(kernel name) each time one of our Triton autotuners times a candidate: a key it had
        not tuned, met at a launch, which waits for the timing of every candidate. None stops it. False, and nothing
        installed, where our Triton kernels are not loaded. The server watches after ready, where the shape sweep should
        have left nothing to tune. Only the benchmark function is wrapped, so an untuned launch pays the callback and a
        tuned one nothing; the callback's errors are logged, never raised into the launch."""
        if "fusedserve.kernels.triton._common" not in sys.modules:
            return False
        from fusedserve.kernels.triton._common import TUNERS

        for name, tuner in TUNERS.items():
            # the autotuner reads its benchmark through `do_bench`, a cached property: an attribute on the instance
            # shadows it, and taking that attribute away shows the autotuner's own again
            if callback is None:
                if _own_benches.pop(name, None) is not None:
                    del tuner.__dict__["do_bench"]
                continue
            own = _own_benches.setdefault(name, tuner.do_bench)
            tuner.__dict__["do_bench"] = _watched_bench(own, name, callback)
        return True


    _own_benches: dict[str, Callable] = {}  # while watch_autotunes is on: each autotuner's own benchmark, by kernel


    def _watched_bench(bench: Callable, name: str, callback: Callable[[str], None]) -> Callable:
        def timed(*args, **kwargs):
            try:
                callback(name)
            except Exception:
                log.exception("the autotune watcher failed")
            return bench(*args, **kwargs)

        return timed


    def pdl_enabled(device: torch.device | str) -> bool:
        """Whether our Triton kernels launched on `device` now use programmatic dependent launch (a GPU of sm_90 or
        later, FUSEDSERVE_TRITON_PDL not 0); False where the Triton backend was not loaded."""
        if "fusedserve.kernels.triton._common" not in sys.modules:
            return False
        from fusedserve.kernels.triton._common import pdl_enabled as triton_pdl_enabled

        return triton_pdl_enabled(torch.device(device))


    def cuda_launch_configs() -> dict[str, dict]:
        """The CUDA backend's launch configurations chosen so far (kernel|dtype|width|row bucket -> config and timings);
        empty where the CUDA backend was not loaded."""
        if "fusedserve.kernels.cuda.tuning" not in sys.modules:
            return {}
        from fusedserve.kernels.cuda.tuning import TUNER

        return TUNER.table()


    def save_tuning(device: torch.device | str) -> None:
        """Keep what the Triton autotuners chose in this process (kernels.cache's Triton table) for the next start on
        this GPU model; nothing off CUDA or before the Triton backend was loaded. The CUDA launch tuning and the races
        are saved as they are made."""
        device = torch.device(device)
        if device.type == "cuda" and "fusedserve.kernels.triton._common" in sys.modules:
            from fusedserve.kernels import cache

            cache.save_triton(device)


    @contextlib.contextmanager
    def compile_only() -> Iterator[None]:
        """Inside, on this thread, our Triton kernels' launches compile what they would run, side by side, and run
        nothing (their outputs are left unwritten); on exit every compile is done (kernels.triton._common.compile_only).
        For a throw-away pass ahead of the same launches for real, such as the server's shape sweep. Other backends' ops
        run as usual; nothing changes before the Triton backend was loaded."""
        if "fusedserve.kernels.triton._common" not in sys.modules:
            yield
            return
        from fusedserve.kernels.triton._common import compile_only as triton_compile_only

        with triton_compile_only():
            yield


    registry.register_backend("triton", _load_triton, compile_only=compile_only)


    def _load_cuda(device: torch.device):
        if device.type != "cuda":
            raise BackendUnavailable(f"needs a CUDA device, got {device}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA is not available")
        from fusedserve.kernels import cuda, library

        try:
            launchers = cuda.load()
        except cuda.BuildUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        return library.custom_ops("cuda", launchers)


    registry.register_backend("cuda", _load_cuda)


    def _load_cpu(device: torch.device):
        if device.type != "cpu":
            raise BackendUnavailable(f"needs the CPU, got {device}")
        from fusedserve.kernels import library
        from fusedserve.kernels.cpu import LAUNCHERS

        return library.custom_ops("cpu", LAUNCHERS)


    registry.register_backend("cpu", _load_cpu)
