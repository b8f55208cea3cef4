"""The backend registry: probing, self-test, preference order, forcing, per-op overrides, fused off, and the
immutable Selection it returns (dispatch through kernels.use, derived selections, versions)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import reference, registry
from fusedserve.kernels.registry import BackendError, BackendUnavailable
from fusedserve.kernels.spec import ops_of
from tests.kernels._shared import install_fake_clock


def _fake_compile_pass():
    """A stand-in backend's compile pass (Backend.compile_only): entering it compiles nothing here."""
    return contextlib.nullcontext()


def _drifting_layer_norm(x, w, b, eps, *, out=None):
    # a plausible bug: a 1% gain error
    result = reference.layer_norm(x, w * 1.01, b, eps)
    return out.copy_(result) if out is not None else result


@pytest.fixture
def fake_backends():
    """Four fake fused backends ahead of the reference. Three say their kernels compile on their first launch (they
    have a compile pass): 'broken' (wrong layer_norm), 'good' (correct layer_norm and bias_gelu, nothing else) and
    'missing' (cannot load here). 'prebuilt' (correct layer_norm) has none."""
    calls = {"good": 0}

    def good_layer_norm(*args, **kwargs):
        calls["good"] += 1
        return reference.layer_norm(*args, **kwargs)

    def load_missing(device):
        raise BackendUnavailable("no such package (fake)")

    def prebuilt_layer_norm(*args, **kwargs):
        return reference.layer_norm(*args, **kwargs)

    # placed ahead of the real fused backends, so the outcome does not depend on what this machine has
    first = registry.backend_names()[0]
    registry.register_backend("missing", load_missing, before=first, compile_only=_fake_compile_pass)
    registry.register_backend("broken", lambda device: {"layer_norm": _drifting_layer_norm}, before=first,
                              compile_only=_fake_compile_pass)
    registry.register_backend("good", lambda device: {"layer_norm": good_layer_norm,
                                                      "bias_gelu": reference.bias_gelu}, before=first,
                              compile_only=_fake_compile_pass)
    # built ahead, as CUDA's kernels are: a compile pass would only run its self-tests twice
    registry.register_backend("prebuilt", lambda device: {"layer_norm": prebuilt_layer_norm}, before=first)
    yield calls
    for name in ("missing", "broken", "good", "prebuilt"):
        registry.unregister_backend(name)


def test_every_op_of_the_spec_is_a_public_callable_with_its_signature_and_doc():
    """kernels.<op> for each op of kernels.spec (the one op list), introspectable as the op it stands for, and every
    name of __all__ there."""
    import inspect

    from fusedserve.kernels import layer_norm
    from fusedserve.kernels.library import signature
    from fusedserve.kernels.spec import OP_SPECS

    assert layer_norm is kernels.layer_norm
    for op, spec in OP_SPECS.items():
        public = getattr(kernels, op)
        assert op in kernels.__all__ and public.__name__ == op and public.__module__ == "fusedserve.kernels"
        assert public.__doc__ == spec.doc and inspect.signature(public) == signature(spec)
        assert "out" not in inspect.signature(public).parameters
    assert all(hasattr(kernels, name) for name in kernels.__all__)


def test_preference_order(fake_backends):
    names = registry.backend_names()
    assert names[:3] == ["missing", "broken", "good"] and names[-1] == "torch"
    assert names.index("triton") < names.index("torch")


def test_auto_skips_failing_and_unavailable_backends_with_reasons(fake_backends):
    # only the ops this test is about: every other op would self-test the real backends, which the sweeps cover
    sel = kernels.select("cpu", (torch.float32, torch.bfloat16), ops=("layer_norm", "bias_gelu", "add_layer_norm"))
    ln = sel.choices["layer_norm"]
    assert ln.backend == "good"
    assert ln.rejected["missing"] == "unavailable: no such package (fake)"
    assert ln.rejected["broken"].startswith("self-test failed at 1x7 float32")
    assert sel.backend_of("bias_gelu") == "good"
    add_ln = sel.choices["add_layer_norm"]
    assert add_ln.backend in ("triton", "torch")  # the first real backend that passes here
    assert add_ln.rejected["broken"] == "does not implement this op"
    assert add_ln.rejected["good"] == "does not implement this op"
    # the public op dispatches to the chosen implementation where the selection is in use
    before = fake_backends["good"]
    x = torch.randn(3, 8)
    with kernels.use(sel):
        kernels.layer_norm(x, torch.ones(8), torch.zeros(8))
    assert fake_backends["good"] == before + 1
    text = sel.report()
    assert "layer_norm" in text and "rejected broken: self-test failed" in text


def test_forced_backend_that_fails_raises(fake_backends):
    with pytest.raises(BackendError, match="'broken' was forced for op 'layer_norm'.*self-test failed"):
        kernels.select("cpu", (torch.float32,), overrides={"layer_norm": "broken"})
    with pytest.raises(BackendError, match="'missing' was forced.*no such package"):
        kernels.select("cpu", (torch.float32,), backend="missing")
    # forcing a backend for an op it lacks is an error too, not a silent fallback
    with pytest.raises(BackendError, match="'good' was forced for op 'layer_norm_gelu'.*does not implement"):
        kernels.select("cpu", (torch.float32,), overrides={"layer_norm_gelu": "good"})


def test_a_backend_forced_for_every_op_leaves_the_ops_it_lacks_on_the_reference_and_says_so(fake_backends):
    # (the CUDA backend has no qkv_attention: BACKEND=cuda must still start, with that op on the torch reference)
    sel = kernels.select("cpu", (torch.float32,), backend="good")
    assert sel.backend_of("layer_norm") == sel.backend_of("bias_gelu") == "good"
    lacking = sel.choices["layer_norm_gelu"]
    assert lacking.backend == "torch" and lacking.reason == "reference path: good (forced) does not implement this op"
    assert "good (forced) does not implement this op" in sel.report()
    assert sel.impls["layer_norm_gelu"] is reference.layer_norm_gelu


def test_per_op_override_wins_over_global(fake_backends):
    sel = kernels.select("cpu", (torch.float32,), backend="torch", overrides={"layer_norm": "good"})
    assert sel.backend_of("layer_norm") == "good"
    assert sel.choices["layer_norm"].reason.startswith("forced by configuration")
    assert sel.backend_of("bias_gelu") == "torch"


def test_fused_off_puts_everything_on_reference(fake_backends):
    sel = kernels.select("cpu", (torch.float32,), fused=False)
    assert {c.backend for c in sel.choices.values()} == {"torch"}
    assert all(c.reason == "fused path disabled by configuration" for c in sel.choices.values())
    assert sel.impls["layer_norm"] is reference.layer_norm


def test_self_test_covers_every_dtype_in_use():
    def fp32_only(x, w, b, eps, *, out=None):
        if x.dtype != torch.float32:
            result = reference.layer_norm(x.float(), w.float(), b.float(), eps).to(x.dtype) * 1.05
        else:
            result = reference.layer_norm(x, w, b, eps)
        return out.copy_(result)

    registry.register_backend("fp32only", lambda device: {"layer_norm": fp32_only}, before=registry.backend_names()[0])
    try:
        forced, ops = {"layer_norm": "fp32only"}, ("layer_norm",)  # (the real backends' other ops: the sweeps)
        assert kernels.select("cpu", (torch.float32,), overrides=forced, ops=ops).backend_of("layer_norm") == "fp32only"
        with pytest.raises(BackendError, match="float16"):
            kernels.select("cpu", (torch.float32, torch.float16), overrides=forced, ops=ops)
        sel = kernels.select("cpu", (torch.float32, torch.float16), ops=ops)
        assert sel.backend_of("layer_norm") != "fp32only"
        assert "float16" in sel.choices["layer_norm"].rejected["fp32only"]
    finally:
        registry.unregister_backend("fp32only")


def test_crashing_candidate_is_rejected_not_fatal():
    def crash(*args, **kwargs):
        raise RuntimeError("kernel launch failed (fake)")

    registry.register_backend("crashy", lambda device: {"bias_gelu": crash}, before=registry.backend_names()[0])
    try:
        sel = kernels.select("cpu", (torch.float32,))
        assert sel.backend_of("bias_gelu") != "crashy"
        assert "RuntimeError: kernel launch failed (fake)" in sel.choices["bias_gelu"].rejected["crashy"]
    finally:
        registry.unregister_backend("crashy")


def test_unknown_names_are_configuration_errors():
    with pytest.raises(ValueError, match="unknown backend 'tritonn'"):
        kernels.select("cpu", backend="tritonn")
    with pytest.raises(ValueError, match="unknown op 'layernorm'"):
        kernels.select("cpu", overrides={"layernorm": "torch"})
    with pytest.raises(ValueError, match="cannot be removed"):
        registry.unregister_backend("torch")


def test_selection_as_dict_is_json_ready():
    import json

    sel = kernels.select("cpu", (torch.float32,), backend="torch")
    data = json.loads(json.dumps(sel.as_dict()))
    assert data["ops"]["add_layer_norm"]["backend"] == "torch"
    assert data["dtypes"] == ["float32"]


@pytest.fixture
def clock(monkeypatch):
    """The race's eager timer on a fake clock: a race's outcome is the stand-ins' declared costs, whatever the load."""
    return install_fake_clock(monkeypatch)


def test_auto_mode_races_passing_backends_and_takes_the_fastest(monkeypatch, clock):
    """With race=True (the default on CUDA), every fused backend that passes is timed at the model's shape
    and the fastest wins, whatever the preference order; the timings are reported."""
    def slow_layer_norm(*args, **kwargs):
        clock.advance_us(50_000)
        return reference.layer_norm(*args, **kwargs)

    def fast_layer_norm(*args, **kwargs):
        clock.advance_us(1_000)
        return reference.layer_norm(*args, **kwargs)

    monkeypatch.setattr(registry, "RACE_ROWS", 16)
    monkeypatch.setattr(registry, "RACE_CALLS", 2)
    monkeypatch.setattr(registry, "RACE_ROUNDS", 3)
    # only the two stand-ins race: the Triton interpreter's timing at 16x48 is close to the reference's and made
    # the outcome depend on the machine's load (a CI run saw triton win the second race)
    monkeypatch.setattr(registry, "_BACKENDS", [b for b in registry._BACKENDS if b.name == registry.REFERENCE_BACKEND])
    registry.register_backend("slow", lambda device: {"layer_norm": slow_layer_norm})
    registry.register_backend("fast", lambda device: {"layer_norm": fast_layer_norm})  # behind "slow"
    try:
        sel = kernels.select("cpu", (torch.float32,), hidden_sizes=(48,), race=True)
        ln = sel.choices["layer_norm"]
        assert ln.backend == "fast", ln
        assert ln.timings_us == pytest.approx({"slow": 50_000, "fast": 1_000})
        assert ln.reason.startswith("fastest of") and "eager timing, at 16x48 float32" in ln.reason
        assert sel.as_dict()["ops"]["layer_norm"]["timings_us"]["fast"] == ln.timings_us["fast"]
        # device timing needs CUDA graphs: off the GPU the race falls back to eager calls and says so
        dev = kernels.select("cpu", (torch.float32,), hidden_sizes=(48,), race=True, race_timing="device")
        assert dev.backend_of("layer_norm") == "fast"
        assert "eager (no CUDA graphs on this device) timing" in dev.choices["layer_norm"].reason
        with pytest.raises(ValueError, match="race_timing"):
            kernels.select("cpu", race_timing="wall")
        # without the race (the default off the GPU) the first that passes in preference order is kept
        assert kernels.select("cpu", (torch.float32,), hidden_sizes=(48,)).backend_of("layer_norm") == "slow"
    finally:
        registry.unregister_backend("slow")
        registry.unregister_backend("fast")


def test_the_race_takes_each_backends_best_round_so_interference_does_not_decide(monkeypatch, clock):
    """A backend that is faster on its own but was disturbed in most rounds (another replica's self-tests on the
    same GPU) still wins: interference only adds time, so the race compares each backend's best round."""
    calls = {"n": 0}

    def disturbed(*args, **kwargs):  # 2 ms alone, 30 ms more in two calls of every three
        calls["n"] += 1
        clock.advance_us(2_000 + (30_000 if calls["n"] % 3 else 0))
        return reference.layer_norm(*args, **kwargs)

    def steady(*args, **kwargs):  # 12 ms every call
        clock.advance_us(12_000)
        return reference.layer_norm(*args, **kwargs)

    monkeypatch.setattr(registry, "RACE_ROWS", 16)
    monkeypatch.setattr(registry, "RACE_CALLS", 1)
    monkeypatch.setattr(registry, "_BACKENDS", [b for b in registry._BACKENDS if b.name == registry.REFERENCE_BACKEND])
    registry.register_backend("steady", lambda device: {"layer_norm": steady})
    registry.register_backend("disturbed", lambda device: {"layer_norm": disturbed})
    try:
        sel = kernels.select("cpu", (torch.float32,), hidden_sizes=(48,), race=True)
        ln = sel.choices["layer_norm"]
        assert registry.RACE_ROUNDS == 9
        assert ln.backend == "disturbed", ln
        # the median of disturbed's rounds (32 ms: disturbed in 6 of the 9) would have lost to steady's 12 ms; its best
        # round (2 ms) wins
        assert ln.timings_us == pytest.approx({"disturbed": 2_000, "steady": 12_000}), ln.timings_us
    finally:
        registry.unregister_backend("steady")
        registry.unregister_backend("disturbed")


def test_cuda_backend_is_registered_and_reports_why_it_cannot_run_here():
    assert registry.backend_names().index("cuda") < registry.backend_names().index("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the CUDA backend is exercised by tests/kernels/test_cuda_ops.py")
    with pytest.raises(BackendError, match="'cuda' was forced.*unavailable: needs a CUDA device, got cpu"):
        kernels.select("cpu", (torch.float32,), backend="cuda")
    # auto mode probes it, records why, and moves on (race=True so every fused backend is probed, as on a GPU). Not
    # the CPU backend's ops: both it and the interpreter would pass, and the race would time interpreted GEMMs
    ops = [op for op in kernels.OPS if op not in ops_of("cpu")]
    sel = kernels.select("cpu", (torch.float32,), race=True, ops=ops)
    for op in ops:
        choice = sel.choices[op]
        assert choice.rejected["cuda"] == "unavailable: needs a CUDA device, got cpu"
        assert choice.backend in ("triton", "torch")
    assert "rejected cuda for every op: unavailable: needs a CUDA device, got cpu" in sel.report()


def test_an_op_no_fused_backend_can_run_here_says_so_rather_than_failed(fake_backends, monkeypatch):
    """Auto mode leaves an op on the reference for one of two reasons, and says which: no fused backend can run it
    here (cannot load on this device, or lacks the op: a CPU server), or one that could failed its self-test."""
    every = list(registry._BACKENDS)

    def only(*names):
        monkeypatch.setattr(registry, "_BACKENDS", [b for b in every if b.name in (*names, "torch")])

    only("missing", "good")
    sel = kernels.select("cpu", (torch.float32,), ops=("layer_norm_gelu",))
    assert sel.choices["layer_norm_gelu"].reason == ("reference path: no fused backend runs this op on cpu (missing "
                                                     "cannot run here; good does not implement it)")
    only("missing", "broken")
    sel = kernels.select("cpu", (torch.float32,), ops=("layer_norm",))
    assert sel.choices["layer_norm"].reason == "reference path: no fused backend passed its self-test"
    assert sel.choices["layer_norm"].rejected["broken"].startswith("self-test failed")
    only("cuda")  # the real CUDA backend on the CPU, as a CPU-only server meets it
    sel = kernels.select("cpu", (torch.float32,), ops=("layer_norm",))
    assert sel.choices["layer_norm"].reason == ("reference path: no fused backend runs this op on cpu (cuda cannot run "
                                                "here)")
    assert "passed" not in sel.report()


def test_the_ffn_in_gemm_races_at_the_ffn_shape(monkeypatch):
    """linear_bias_gelu is raced at [RACE_ROWS, 4 x hidden] out of [RACE_ROWS, hidden] (the FFN-in), not at the
    row-wise ops' [RACE_ROWS, hidden], and the report says so."""
    monkeypatch.setattr(registry, "RACE_ROWS", 16)
    monkeypatch.setattr(registry, "RACE_CALLS", 1)
    monkeypatch.setattr(registry, "RACE_ROUNDS", 1)
    monkeypatch.setattr(registry, "_BACKENDS", [b for b in registry._BACKENDS if b.name == registry.REFERENCE_BACKEND])
    shapes = []

    def recording(x, weight, bias, approximate="none", *, out=None):
        shapes.append((tuple(x.shape), tuple(weight.shape)))
        return reference.linear_bias_gelu(x, weight, bias, approximate, out=out)

    registry.register_backend("one", lambda device: {"linear_bias_gelu": recording})
    registry.register_backend("two", lambda device: {"linear_bias_gelu": reference.linear_bias_gelu})
    try:
        sel = kernels.select("cpu", (torch.float32,), hidden_sizes=(48,), race=True)
        assert ((16, 48), (192, 48)) in shapes  # the race's call
        assert "at 16x192 float32" in sel.choices["linear_bias_gelu"].reason
        assert sel.choices["layer_norm"].backend == registry.REFERENCE_BACKEND  # the stand-ins implement one op
    finally:
        registry.unregister_backend("one")
        registry.unregister_backend("two")


def test_a_selection_is_immutable_and_runs_only_where_it_is_used(fake_backends):
    """No process-wide table: kernels.<op> runs the selection installed by kernels.use in this context only, the
    reference elsewhere (another thread included), and a selection cannot be changed once made."""
    import threading

    sel = kernels.select("cpu", (torch.float32,), backend="good")
    with pytest.raises(TypeError):
        sel.impls["layer_norm"] = reference.layer_norm
    with pytest.raises(AttributeError):
        sel.version = 7
    x, w, b = torch.randn(3, 8), torch.rand(8) + 0.5, torch.randn(8)
    calls = fake_backends["good"]
    with kernels.use(sel) as used:
        assert used is sel and kernels.current() is sel
        kernels.layer_norm(x, w, b)
        assert fake_backends["good"] == calls + 1
        seen = []
        worker = threading.Thread(target=lambda: seen.append(kernels.current()))
        worker.start()
        worker.join()
        assert seen == [kernels.REFERENCE]  # another thread does not see this context's selection
    assert kernels.current() is kernels.REFERENCE
    kernels.layer_norm(x, w, b)
    assert fake_backends["good"] == calls + 1  # outside use(): the reference ran


def test_derived_selections_get_new_versions_and_say_why(fake_backends):
    sel = kernels.select("cpu", (torch.float32,), backend="good")
    fallen = sel.on_reference(["layer_norm"], "fallback: verify_mismatch")
    assert fallen.version > sel.version and sel.backend_of("layer_norm") == "good"
    assert fallen.backend_of("layer_norm") == "torch" and fallen.impls["layer_norm"] is reference.layer_norm
    assert fallen.choices["layer_norm"].reason == "fallback: verify_mismatch"
    assert fallen.backend_of("bias_gelu") == "good"
    wrapped = fallen.with_impl("bias_gelu", reference.bias_gelu, "wrapped")
    assert wrapped.version > fallen.version and wrapped.backend_of("bias_gelu") == "good"
    with pytest.raises(ValueError, match="unknown op"):
        sel.on_reference(["layernorm"], "x")


def test_an_observer_sees_every_op_call_with_its_backend(fake_backends):
    sel = kernels.select("cpu", (torch.float32,), backend="good")
    seen = []

    def observer(op, backend, fn, args, kwargs):
        seen.append((op, backend))
        return fn(*args, **kwargs)

    x, w, b = torch.randn(3, 8), torch.rand(8) + 0.5, torch.randn(8)
    with kernels.use(sel, observer):
        out = kernels.layer_norm(x, w, b)
        kernels.layer_norm_gelu(x, w, b)
    assert seen == [("layer_norm", "good"), ("layer_norm_gelu", "torch")]
    torch.testing.assert_close(out, reference.layer_norm(x, w, b))


def test_the_self_tests_kernels_are_compiled_ahead_inside_one_compile_pass(monkeypatch):
    """On a GPU, select first runs every candidate's self-test inputs inside kernels.compile_only (so their kernels
    compile side by side), then the self-tests proper. Here the pass is recorded, and a fn whose verdict is cached
    (it ran its self-test already) is not run again."""
    passes, calls = [], []

    class Pass:
        def __enter__(self):
            passes.append("open")

        def __exit__(self, *exc):
            passes.append("closed")

    def recorded(x, w, b, eps, *, out=None):
        calls.append((passes[-1] if passes else None, tuple(x.shape), x.dtype))
        return out.copy_(reference.layer_norm(x, w, b, eps))

    dtypes, cols = (torch.float32, torch.float16), (7, 300)
    registry._compile_self_tests([Pass], [(recorded, "layer_norm")], torch.device("cpu"), dtypes, cols)
    assert passes == ["open", "closed"]
    expected = {("open", (rows, n), dtype) for dtype in dtypes for rows in registry.SELF_TEST_ROWS for n in cols}
    assert set(calls) == expected and len(calls) == len(expected)
    assert registry._self_test(recorded, "layer_norm", torch.device("cpu"), dtypes, cols) is None  # the real one
    calls.clear()
    registry._compile_self_tests([Pass], [(recorded, "layer_norm")], torch.device("cpu"), dtypes, cols)
    assert calls == []  # its verdict is known: no self-test will run, nothing to compile


def test_on_a_gpu_select_compiles_the_fused_candidates_self_tests_first(fake_backends, monkeypatch):
    """select's CUDA branch, driven here with stand-ins: before any self-test runs, one compile pass gets every
    fused candidate of every wanted op whose kernels compile on launch (forced backends and per-op overrides
    respected; the reference, backends built ahead, and backends that do not load or lack the op left out)."""
    order = []
    monkeypatch.setattr(registry, "_compile_self_tests",
                        lambda passes, fns, device, dtypes, cols: order.append(("pass", {op for _, op in fns},
                                                                                {fn.__name__ for fn, _ in fns}, cols,
                                                                                passes)))

    def self_test(fn, op, device, dtypes, cols):
        order.append(("self-test", op))
        return None

    monkeypatch.setattr(registry, "_self_test", self_test)
    monkeypatch.setattr(registry, "_race", lambda op, impls, *args: ({name: 1.0 for name in impls}, "device"))
    monkeypatch.setattr(registry, "_BACKENDS", [b for b in registry._BACKENDS if b.name not in ("triton", "cuda")])
    sel = kernels.select("cuda", (torch.float16,), hidden_sizes=(384,), ops=("layer_norm", "bias_gelu"))
    assert order[0] == ("pass", {"layer_norm", "bias_gelu"}, {"_drifting_layer_norm", "good_layer_norm", "bias_gelu"},
                        (*registry.SELF_TEST_COLS, 384), [_fake_compile_pass])  # the stand-ins' one pass, entered once
    assert all(step[0] == "self-test" for step in order[1:]) and len(order) > 1
    assert sel.backend_of("layer_norm") in ("broken", "good")  # passed (stubbed) and raced
    order.clear()
    kernels.select("cuda", (torch.float16,), ops=("layer_norm",), overrides={"layer_norm": "good"})
    assert order[0][1:3] == ({"layer_norm"}, {"good_layer_norm"})  # only what is forced is compiled
    order.clear()
    kernels.select("cuda", (torch.float16,), ops=("layer_norm",), fused=False)
    assert order == []  # fused off: nothing probed, nothing compiled


def test_triton_kernels_compile_on_launch_and_the_cuda_extensions_do_not():
    """What decides which self-tests join the compile pass: Triton's kernels honour kernels.compile_only(), handed to
    the registry as the Triton backend's compile pass; the CUDA extension is built ahead, so a compile pass would only
    run its self-tests twice."""
    passes = {b.name: b.compile_only for b in registry._BACKENDS}
    assert passes["triton"] is kernels.compile_only and passes["cuda"] is None and passes["torch"] is None
