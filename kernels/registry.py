"""Per-op backend choice, returned as an immutable `Selection` that its owner (the model's Embedder) keeps and
installs around its forwards (`kernels.use`): there is no process-wide op table to write.

Each backend (triton, cuda, cpu, torch) is probed once (importable? usable on this device?), then self-tested op by op
against the float64 reference on fresh random inputs of a few shapes and every dtype in use. Auto mode self-tests
every fused backend; when more than one passes it races them at the model's shape (RACE_ROWS x hidden size,
serving dtype) and takes the fastest, else the one that passed; the reference is the fallback. Ops the model will
not call (`ops=`) stay on the reference untested, so a server start compiles no kernel it will never launch. Why
every other backend was rejected is recorded; an explicitly forced backend that fails raises (one forced for every
op that does not implement some op leaves that op on the reference; forced for that op alone, it raises).
On a GPU the race timings are saved in the cache directory (kernels.cache, keyed by the GPU model, the versions and
the kernel sources): a later start self-tests again on fresh inputs but takes the saved race.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import textwrap
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fusedserve.kernels import cache
from fusedserve.kernels import timing as timing_
from fusedserve.kernels.spec import OP_SPECS, OPS, REFERENCE_OPS
from fusedserve.kernels.testing import check_op

log = logging.getLogger("fusedserve.kernels")

REFERENCE_BACKEND = "torch"


class BackendUnavailable(RuntimeError):
    """Raised by a backend loader that cannot run here (missing package, no device, ...)."""


class BackendError(RuntimeError):
    """An explicitly requested backend is unavailable or failed its self-test."""


# A loader gets the target device and returns {op name: implementation} or raises BackendUnavailable.
Loader = Callable[[torch.device], Mapping[str, Callable]]


# For a backend whose kernels compile on their first launch (Triton's): a context inside which its launches compile
# what they would run, side by side, and run nothing (kernels.compile_only).
CompilePass = Callable[[], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class Backend:
    name: str
    loader: Loader
    # given, the self-tests' launches are made once inside it first, so their compiles run side by side instead of
    # one launch at a time; a backend built ahead (CUDA's) has none: its self-tests would only run twice
    compile_only: CompilePass | None = None


def _load_reference(device: torch.device) -> Mapping[str, Callable]:
    return REFERENCE_OPS


# Preference order for auto mode; fused backends register themselves ahead of the reference.
_BACKENDS: list[Backend] = [Backend(REFERENCE_BACKEND, _load_reference)]


def register_backend(name: str, loader: Loader, *, before: str = REFERENCE_BACKEND,
                     compile_only: CompilePass | None = None) -> None:
    """Add (or replace) a backend, placed just ahead of `before` in the preference order. compile_only: for a
    backend whose kernels compile on their first launch, its compile pass (see Backend)."""
    unregister_backend(name)
    index = next(i for i, b in enumerate(_BACKENDS) if b.name == before)
    _BACKENDS.insert(index, Backend(name, loader, compile_only))


def unregister_backend(name: str) -> None:
    if name == REFERENCE_BACKEND:
        raise ValueError("the reference backend cannot be removed")
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != name]


def backend_names() -> list[str]:
    return [b.name for b in _BACKENDS]


@dataclass(frozen=True)
class OpChoice:
    op: str
    backend: str
    reason: str
    rejected: Mapping[str, str] = field(default_factory=dict)
    timings_us: Mapping[str, float] = field(default_factory=dict)  # the auto-mode race, when there was one
    used: bool = True  # False: the model does not call this op; it stays on the reference, untested

    def __post_init__(self) -> None:  # read-only views: a Selection never changes once made
        object.__setattr__(self, "rejected", types.MappingProxyType(dict(self.rejected)))
        object.__setattr__(self, "timings_us", types.MappingProxyType(dict(self.timings_us)))


_versions = itertools.count(1)  # 0 is the reference selection every thread starts with


@dataclass(frozen=True)
class Selection:
    """Which implementation runs each op, on which backend and why. Immutable: a change of path (the fused
    switch, a fallback) makes a new Selection with a higher `version`, which is what CUDA graphs are keyed on."""

    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    fused: bool  # the fused path was asked for (False: every op on the reference by configuration)
    choices: Mapping[str, OpChoice]
    impls: Mapping[str, Callable]
    seconds: float = 0.0
    # set at construction, never passed in: dataclasses.replace() or a caller cannot make two selections share one
    version: int = field(init=False)
    any_fused: bool = field(init=False)  # some op the model calls runs something other than its torch reference

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", types.MappingProxyType(dict(self.choices)))
        object.__setattr__(self, "impls", types.MappingProxyType(dict(self.impls)))
        object.__setattr__(self, "version", next(_versions))
        object.__setattr__(self, "any_fused", any(self.impls[op] is not REFERENCE_OPS[op]
                                                  for op, c in self.choices.items() if c.used))

    def backend_of(self, op: str) -> str:
        return self.choices[op].backend

    @property
    def used(self) -> dict[str, str]:
        """{op: backend} for the ops the model calls."""
        return {op: c.backend for op, c in self.choices.items() if c.used}

    def on_reference(self, ops: Iterable[str], reason: str) -> Selection:
        """A new selection with `ops` on the torch reference, each choice's reason saying why."""
        ops = set(ops)
        if unknown := ops - set(OPS):
            raise ValueError(f"unknown op(s) {sorted(unknown)}; ops are {', '.join(OPS)}")
        choices = {op: (replace(c, backend=REFERENCE_BACKEND, reason=reason, timings_us={}) if op in ops else c)
                   for op, c in self.choices.items()}
        impls = {op: (REFERENCE_OPS[op] if op in ops else fn) for op, fn in self.impls.items()}
        return Selection(self.device, self.dtypes, self.fused, choices, impls, self.seconds)

    def with_impl(self, op: str, impl: Callable, reason: str) -> Selection:
        """A new selection running `impl` for `op` on the same backend (tests wrap an op with a fault this way)."""
        choices = {**self.choices, op: replace(self.choices[op], reason=reason)}
        return Selection(self.device, self.dtypes, self.fused, choices, {**self.impls, op: impl}, self.seconds)

    def report(self) -> str:
        """The human-readable table logged at startup and shown by the CLI."""
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
        lines = [f"kernel backends (device {self.device}, dtypes {dtypes}, fused path "
                 f"{'on' if self.fused else 'off'}, chosen in {self.seconds:.2f}s):"]
        used = [c for c in self.choices.values() if c.used]
        # a backend rejected for the same reason on every op (typically: unavailable here) is said once
        everywhere = {name: why for name, why in (used[0].rejected.items() if used else ())
                      if all(c.rejected.get(name) == why for c in used)}
        for name, why in everywhere.items():
            lines.append(f"  rejected {name} for every op: {why}")
        width = max(map(len, self.choices))
        for choice in used:
            lines.append(f"  {choice.op:<{width}}  {choice.backend:<6}  {choice.reason}")
            for name, why in choice.rejected.items():
                if name not in everywhere:
                    lines.append(f"  {'':<{width}}    rejected {name}: {why}")
        unused = [c.op for c in self.choices.values() if not c.used]
        if unused:
            lines += textwrap.wrap(f"not called by this model (reference, not tested): {', '.join(unused)}", 112,
                                   initial_indent="  ", subsequent_indent="    ")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "device": str(self.device),
            "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
            "fused": self.fused,
            "version": self.version,
            "ops": {c.op: {"backend": c.backend, "reason": c.reason, "rejected": dict(c.rejected),
                           **({"timings_us": dict(c.timings_us)} if c.timings_us else {}),
                           **({} if c.used else {"used": False})}
                    for c in self.choices.values()},
        }


def reference_selection(device: torch.device | str = "cpu", dtypes: Iterable[torch.dtype] = (torch.float32,),
                        reason: str = "reference path") -> Selection:
    """Every op on the torch reference."""
    choices = {op: OpChoice(op, REFERENCE_BACKEND, reason) for op in OPS}
    return Selection(torch.device(device), tuple(dtypes), False, choices, REFERENCE_OPS)


# What kernels.<op> runs outside any kernels.use(...): the reference, so the package works unconfigured.
REFERENCE = reference_selection()
object.__setattr__(REFERENCE, "version", 0)

_NOT_IMPLEMENTED = "does not implement this op"
_UNAVAILABLE = "unavailable: "  # how a backend that cannot load here is rejected

# Self-test sizes: a single row, an odd row count, and the model's own width plus an awkward one.
SELF_TEST_ROWS = (1, 37)
SELF_TEST_COLS = (7, 300)


# Self-test verdicts per implementation (weakly held) and (op, device, dtypes, cols): the inputs are seeded, so the
# same implementation gets the same verdict; a process that configures again (a test suite, a fused-path toggle)
# does not re-run them (on the Triton interpreter the attention ops' self-tests take seconds).
_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _self_test(fn: Callable, op: str, device: torch.device, dtypes: Iterable[torch.dtype],
               cols: Iterable[int]) -> str | None:
    """None if `fn` matches the reference on every shape and dtype, else the first failure (cached per fn)."""
    dtypes, cols = tuple(dtypes), tuple(cols)
    key = (op, str(device), dtypes, cols)
    try:
        known = _verdicts.setdefault(fn, {})
    except TypeError:  # not weakly referenceable: no cache
        known = {}
    if key not in known:
        known[key] = _run_self_test(fn, op, device, dtypes, cols)
    return known[key]


def _compile_self_tests(passes: Sequence[CompilePass], fns: list[tuple[Callable, str]], device: torch.device,
                        dtypes: tuple, cols: tuple) -> None:
    """Compile the kernels the self-tests of these (fn, op) will launch, side by side, before they run one after
    another: inside the backends' compile passes (Backend.compile_only: the launches compile and run nothing; each
    check's verdict is thrown away). A fn whose verdict is cached runs no self-test and is skipped."""
    with contextlib.ExitStack() as inside:
        for compile_pass in passes:
            inside.enter_context(compile_pass())
        for fn, op in fns:
            with contextlib.suppress(TypeError):
                if (op, str(device), dtypes, cols) in _verdicts.get(fn, {}):
                    continue
            for dtype in dtypes:
                for rows in SELF_TEST_ROWS:
                    for n in cols:
                        with contextlib.suppress(Exception):  # the self-test proper reports any failure
                            check_op(fn, op, rows, n, dtype, device, seed=0)


def _run_self_test(fn: Callable, op: str, device: torch.device, dtypes: tuple, cols: tuple) -> str | None:
    seed = 0
    for dtype in dtypes:
        for rows in SELF_TEST_ROWS:
            for n in cols:
                seed += 1
                try:
                    report = check_op(fn, op, rows, n, dtype, device, seed=seed)
                except Exception as exc:  # a crash in a candidate is a rejection, not a startup failure
                    log.warning("self-test of %s on %s raised; rejecting it", op, device, exc_info=True)
                    return f"self-test raised {type(exc).__name__}: {exc}"
                if not report.ok:
                    return f"self-test failed at {rows}x{n} {str(dtype).removeprefix('torch.')}: {report}"
    return None


# The auto-mode race: per-call time of each passing fused backend on [RACE_ROWS, hidden] inputs (a typical
# batch's token count), the best of interleaved rounds. timing="eager": calls launched from Python back to back,
# as the eager serving path makes them (host launch cost included); timing="device": RACE_CALLS calls captured
# in a CUDA graph and replayed, the device time that counts when the model runs from CUDA graphs.
# Best, not median: interference only ever adds time, and replicas starting together on one GPU time their
# kernels beside each other's self-tests.
RACE_ROWS = 4096
RACE_CALLS = 20
RACE_ROUNDS = 9
RACE_TIMINGS = ("eager", "device")
_race_cache: dict[tuple, tuple[dict[str, float], str]] = {}


def _race(op: str, impls: Mapping[str, Callable], device: torch.device, dtype: torch.dtype,
          cols: int, timing: str = "eager") -> tuple[dict[str, float], str]:
    """Microseconds per call of each implementation of `op` on the same inputs, and how they were timed
    ("device" falls back to "eager" when graph capture is impossible); cached per process."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    key = (op, name, dtype, RACE_ROWS, cols, tuple(impls), timing)
    if key in _race_cache:
        return _race_cache[key]
    saved = _saved_races(device)
    entry = f"{op}|{str(dtype).removeprefix('torch.')}|{RACE_ROWS}|{cols}|{','.join(impls)}|{timing}"
    if entry in saved:  # an earlier start on this GPU model, versions and kernel sources raced these already
        _race_cache[key] = ({n: float(us) for n, us in saved[entry]["us"].items()}, saved[entry]["how"])
        return _race_cache[key]
    args, kwargs = OP_SPECS[op].make_inputs(RACE_ROWS, cols, dtype, device, torch.Generator().manual_seed(7))
    calls = {n: (lambda fn=fn: fn(*args, **kwargs)) for n, fn in impls.items()}
    for call in calls.values():  # warm-up: compilation, autotuning and launch-config sweeps happen here
        timing_.eager_us(call, device, calls=1, rounds=1, warmup=3)
    how = timing
    if timing == "device" and device.type != "cuda":
        how, timing = "eager (no CUDA graphs on this device)", "eager"
    try:
        timings = timing_.interleaved_us(calls, device, timing=timing, calls=RACE_CALLS, rounds=RACE_ROUNDS)
    except Exception as exc:  # a backend that cannot be captured still gets a fair (eager) race
        if timing != "device":
            raise
        log.warning("race for %s: device timing failed (%s: %s); timing eager calls", op, type(exc).__name__, exc,
                    exc_info=True)
        how = f"eager (device timing failed: {type(exc).__name__})"
        timings = timing_.interleaved_us(calls, device, timing="eager", calls=RACE_CALLS, rounds=RACE_ROUNDS)
    _race_cache[key] = (timings, how)
    if device.type == "cuda" and how == timing:  # a fallback timing is this start's makeshift, not kept
        saved[entry] = {"us": {n: round(us, 3) for n, us in timings.items()}, "how": how}
        # under the cache's lock: what other processes saved meanwhile is kept, and this race is added to it
        error = cache.merge_table(cache.gpu_file("races", device), _valid_races, "race timings cache",
                                  lambda table: table.update({entry: saved[entry]}))
        if error is not None:
            log.warning("cannot save the race timings (%s: %s); the next start races again", type(error).__name__,
                        error)
    return _race_cache[key]


_saved: dict[str, dict] = {}


def _valid_races(table: object) -> bool:
    return isinstance(table, dict) and all(
        isinstance(e, dict) and isinstance(e.get("us"), dict) and isinstance(e.get("how"), str)
        and all(isinstance(v, (int, float)) for v in e["us"].values()) for e in table.values())


def _saved_races(device: torch.device) -> dict[str, dict]:
    """The races saved in the cache directory (kernels.cache) for this GPU model, versions and kernel sources; an
    empty table off CUDA (the interpreter's speed says nothing worth keeping)."""
    if device.type != "cuda":
        return {}
    path = str(cache.gpu_file("races", device))
    if path not in _saved:  # this GPU model's shipped races, under what this machine saved
        shipped = {k: v for k, v in cache.shipped("races", device).items() if _valid_races({k: v})}
        _saved[path] = {**shipped, **cache.read_table(Path(path), _valid_races, "race timings cache")}
    return _saved[path]


def _why_reference(rejected: Mapping[str, str], device: torch.device) -> str:
    """Why auto mode left an op on the reference: no fused backend can run it here (said plainly, not as a failure;
    each backend's own reason is in `rejected`), or one that could failed its self-test."""
    fused = {name: why for name, why in rejected.items() if name != REFERENCE_BACKEND}
    groups: dict[str, list[str]] = {}
    for name, why in fused.items():
        if why == _NOT_IMPLEMENTED:
            groups.setdefault("does not implement it", []).append(name)
        elif why.startswith(_UNAVAILABLE):
            groups.setdefault("cannot run here", []).append(name)
        else:
            return "reference path: no fused backend passed its self-test"
    whys = "; ".join(f"{' and '.join(names)} {what}" for what, names in groups.items())
    return f"reference path: no fused backend runs this op on {device.type}" + (f" ({whys})" if whys else "")


def select(
    device: torch.device | str = "cpu",
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    *,
    backend: str = "auto",
    overrides: Mapping[str, str] | None = None,
    fused: bool = True,
    hidden_sizes: Iterable[int] = (),
    race: bool | None = None,
    race_timing: str = "eager",
    ops: Iterable[str] | None = None,
) -> Selection:
    """Choose a backend per op and return the choice (implementations, backends, why) as a new Selection.

    backend: "auto" or a backend name forced for every op; overrides: {op: backend} per op, winning over
    `backend`; fused=False puts every op on the reference path without probing anything. race: time the
    fused backends that pass and take the fastest (default: on CUDA devices; elsewhere the first that passes
    in preference order, since the Triton interpreter's speed says nothing). race_timing: "eager" (the model
    launches ops from Python) or "device" (the model runs from CUDA graphs: device time decides). ops: the ops
    the caller will call (default: all); the others stay on the reference without a self-test, except those named
    in `overrides` (asked for by name, so chosen as asked).
    """
    started = time.perf_counter()
    device = torch.device(device)
    dtypes = tuple(dict.fromkeys(dtypes))
    overrides = dict(overrides or {})
    known = set(backend_names())
    for op, name in overrides.items():
        if op not in OPS:
            raise ValueError(f"backend override for unknown op {op!r}; ops are {', '.join(OPS)}")
        if name != "auto" and name not in known:
            raise ValueError(f"backend override {op}={name!r}: unknown backend; known: {', '.join(sorted(known))}")
    if race_timing not in RACE_TIMINGS:
        raise ValueError(f"race_timing must be one of {RACE_TIMINGS}, got {race_timing!r}")
    if backend != "auto" and backend not in known:
        raise ValueError(f"unknown backend {backend!r}; known: auto, {', '.join(backend_names())}")
    hidden_sizes = tuple(hidden_sizes)
    test_cols = tuple(dict.fromkeys([*SELF_TEST_COLS, *hidden_sizes]))
    race = device.type == "cuda" if race is None else race
    wanted = set(OPS) if ops is None else {*ops, *overrides}
    if unknown := wanted - set(OPS):
        raise ValueError(f"unknown op(s) {sorted(unknown)}; ops are {', '.join(OPS)}")

    loaded: dict[str, Mapping[str, Callable] | str] = {}

    def load(b: Backend) -> Mapping[str, Callable] | str:
        if b.name not in loaded:
            try:
                loaded[b.name] = b.loader(device)
            except BackendUnavailable as exc:
                loaded[b.name] = f"{_UNAVAILABLE}{exc}"
            except Exception as exc:  # a broken backend is skipped (auto) or named (forced), never fatal here
                log.warning("backend %s failed to load on %s", b.name, device, exc_info=True)
                loaded[b.name] = f"{_UNAVAILABLE}failed to load ({type(exc).__name__}: {exc})"
        return loaded[b.name]

    def implementation(name: str, op: str) -> Callable:
        return load(next(b for b in _BACKENDS if b.name == name))[op]

    def candidates_of(op: str) -> list[Backend]:
        forced = overrides.get(op, "auto")
        forced = backend if forced == "auto" else forced
        return [b for b in _BACKENDS if forced in ("auto", b.name)]

    if fused and device.type == "cuda":  # the self-tests' compiles side by side, not one launch at a time
        compiling = [(b, op) for op in OPS if op in wanted for b in candidates_of(op) if b.compile_only is not None]
        fns = [(impl[op], op) for b, op in compiling if not isinstance(impl := load(b), str) and op in impl]
        passes = list({id(b.compile_only): b.compile_only for b, _ in compiling}.values())
        _compile_self_tests(passes, fns, device, dtypes, test_cols)

    choices: dict[str, OpChoice] = {}
    for op in OPS:
        if not fused:
            choices[op] = OpChoice(op, REFERENCE_BACKEND, "fused path disabled by configuration", used=op in wanted)
            continue
        if op not in wanted:
            choices[op] = OpChoice(op, REFERENCE_BACKEND, "not called by this model", used=False)
            continue
        forced = overrides.get(op, "auto")
        forced = backend if forced == "auto" else forced
        candidates = candidates_of(op)
        backend_, reason, rejected, timings_us = "", "", {}, {}
        passed: list[str] = []
        for b in candidates:
            if passed and b.name == REFERENCE_BACKEND:
                break  # a fused backend passed; the reference stays the fallback
            impl = load(b)
            if isinstance(impl, str):
                why = impl
            elif op not in impl:
                why = _NOT_IMPLEMENTED
            else:
                why = _self_test(impl[op], op, device, dtypes, test_cols)
                if why is None:
                    passed.append(b.name)
                    if forced != "auto" or b.name == REFERENCE_BACKEND or not race:
                        break
                    continue
            rejected[b.name] = why
        if len(passed) > 1:
            cols = OP_SPECS[op].race_cols(hidden_sizes[0] if hidden_sizes else 768)
            impls = {n: implementation(n, op) for n in passed}
            timings_us, how = _race(op, impls, device, dtypes[0], cols, race_timing)
            backend_ = min(timings_us, key=timings_us.get)
            times = ", ".join(f"{n} {t:.1f}" for n, t in sorted(timings_us.items(), key=lambda kv: kv[1]))
            reason = (f"fastest of {len(passed)} that passed their self-tests (us/call, {how} timing, at "
                             f"{RACE_ROWS}x{cols} {str(dtypes[0]).removeprefix('torch.')}: {times})")
        elif passed:
            backend_ = passed[0]
            if forced != "auto":
                reason = "forced by configuration; passed its self-test"
            elif passed[0] == REFERENCE_BACKEND:
                reason = _why_reference(rejected, device)
            else:
                reason = "the only fused backend that passed its self-test"
        if (not backend_ and forced != "auto" and overrides.get(op, "auto") == "auto"
                and rejected.get(forced) == _NOT_IMPLEMENTED):
            # a backend forced for every op lacks this one (the CUDA backend has no qkv_attention): the reference
            backend_ = REFERENCE_BACKEND
            reason = f"reference path: {forced} (forced) does not implement this op"
        if not backend_:
            if forced != "auto":
                raise BackendError(f"backend {forced!r} was forced for op {op!r} but cannot be used: "
                                   f"{rejected.get(forced)}")
            raise BackendError(f"no backend passed for op {op!r}: {rejected}")
        choices[op] = OpChoice(op, backend_, reason, rejected, timings_us)
        # progress: on a GPU with a cold Triton cache each op's self-tests and race compile kernels (seconds each)
        done = sum(c.used for c in choices.values())
        log.info("kernel backends: %s -> %s (%d of %d ops, %.1fs)", op, backend_, done,
                 len(wanted), time.perf_counter() - started)

    impls = {op: implementation(c.backend, op) for op, c in choices.items()}
    selection = Selection(device, dtypes, fused, choices, impls, time.perf_counter() - started)
    log.debug("%s", selection.report())  # the caller's startup report shows it
    return selection
