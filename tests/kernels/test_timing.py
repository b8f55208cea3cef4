"""fusedserve.kernels.timing: the eager paths on the CPU (real sleeps compared relatively, and a fake clock where exact
numbers are checked: reducers, per-call division, warm-up left out, interleaving), the CUDA-graph paths on a GPU."""

from __future__ import annotations

import time
import types

import pytest
import torch

from fusedserve.kernels import timing
from tests.kernels._shared import FakeClock, install_fake_clock

CPU = torch.device("cpu")


@pytest.fixture
def clock(monkeypatch):
    return install_fake_clock(monkeypatch)


def _stepper(clock: FakeClock, durations_us: list[float]):
    """A function whose n-th call takes durations_us[n] microseconds of the fake clock."""
    calls = iter(durations_us)
    return lambda: clock.advance_us(next(calls))


# ---- real time: only orderings that hold however loaded the machine is ------------------------------------------


def test_eager_us_measures_a_sleep_as_at_least_its_length_and_more_than_a_no_op():
    slept = timing.eager_us(lambda: time.sleep(0.003), CPU, calls=2, rounds=3, warmup=1)
    nothing = timing.eager_us(lambda: None, CPU, calls=2, rounds=3, warmup=1, reduce="min")
    assert slept >= 3000  # time.sleep never returns early
    assert nothing < slept


def test_interleaved_eager_orders_real_sleeps():
    result = timing.interleaved_us({"sleep": lambda: time.sleep(0.003), "no-op": lambda: None}, CPU,
                                   timing="eager", calls=2, rounds=3)
    assert set(result) == {"sleep", "no-op"}
    assert result["sleep"] >= 3000 and result["no-op"] < result["sleep"]


# ---- fake clock: exact numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("reduce", "expected"), [("min", 1000.0), ("median", 3000.0)])
def test_eager_us_reduces_rounds(clock, reduce, expected):
    # one call per round; rounds take 5, 1, 3 ms: min 1 ms, median 3 ms
    fn = _stepper(clock, [5000.0, 1000.0, 3000.0])
    assert timing.eager_us(fn, CPU, calls=1, rounds=3, reduce=reduce, warmup=0) == pytest.approx(expected)


def test_eager_us_is_per_call_and_leaves_warmup_out(clock):
    # two slow warm-up calls (a compile), then two rounds of four calls of 10 and 30 us: per call 20 us a round
    fn = _stepper(clock, [1e6, 1e6] + [10.0, 30.0] * 4)
    assert timing.eager_us(fn, CPU, calls=4, rounds=2, warmup=2) == pytest.approx(20.0)


def test_interleaved_eager_alternates_candidates_and_reduces_each(clock):
    order = []
    durations = {"a": iter([50.0, 10.0, 30.0]), "b": iter([7.0, 9.0, 8.0])}

    def make(name):
        def fn():
            order.append(name)
            clock.advance_us(next(durations[name]))
        return fn

    result = timing.interleaved_us({"a": make("a"), "b": make("b")}, CPU, timing="eager", calls=1, rounds=3)
    assert order == ["a", "b"] * 3  # no warm-up calls, one round of every candidate at a time
    assert result == {"a": pytest.approx(10.0), "b": pytest.approx(7.0)}  # reduce="min" by default
    durations = {"a": iter([50.0, 10.0, 30.0]), "b": iter([7.0, 9.0, 8.0])}
    median = timing.interleaved_us({"a": make("a"), "b": make("b")}, CPU, timing="eager", calls=1, rounds=3,
                                   reduce="median")
    assert median == {"a": pytest.approx(30.0), "b": pytest.approx(8.0)}


def test_op_timer_on_cpu_records_each_call_in_order(clock):
    timer = timing.OpTimer(CPU)

    def op(us, value):
        clock.advance_us(us)
        return value

    assert timer.call("layer_norm", "triton", op, (40.0, "x"), {}) == "x"
    assert timer.call("bias_gelu", "cuda", op, (), {"us": 15.0, "value": "y"}) == "y"
    results = timer.results()
    assert [(o, b) for o, b, _ in results] == [("layer_norm", "triton"), ("bias_gelu", "cuda")]
    assert [s for _, _, s in results] == [pytest.approx(40e-6), pytest.approx(15e-6)]


# ---- argument errors: raised before anything is timed -----------------------------------------------------------


def test_bad_arguments_fail_before_timing():
    calls = []
    fn = lambda: calls.append(1)  # noqa: E731
    with pytest.raises(ValueError, match="reduce"):
        timing.eager_us(fn, CPU, reduce="mean")
    with pytest.raises(ValueError, match="timing"):
        timing.interleaved_us({"f": fn}, CPU, timing="wall", calls=1, rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        timing.eager_us(fn, CPU, rounds=0)
    with pytest.raises(ValueError, match="reduce"):
        timing.device_us(fn, reduce="mean")
    assert calls == []


def test_device_timing_on_the_cpu_raises_so_a_caller_can_fall_back_to_eager():
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        timing.interleaved_us({"f": lambda: None}, CPU, timing="device", calls=1, rounds=1)


# ---- the CUDA-graph paths ---------------------------------------------------------------------------------------

# torch.cuda._sleep spins the GPU for a number of clock cycles: a kernel of known relative length
_LONG, _SHORT = 2_000_000, 1_000


@pytest.mark.gpu
def test_device_us_orders_spin_kernels_and_reduces():
    long = timing.device_us(lambda: torch.cuda._sleep(_LONG), calls=2, rounds=3)
    short = timing.device_us(lambda: torch.cuda._sleep(_SHORT), calls=2, rounds=3, reduce="min")
    assert 0 < short < long
    cold = timing.device_us(lambda: torch.cuda._sleep(_LONG), calls=1, rounds=2, flush_l2=True)
    assert cold > short


@pytest.mark.gpu
def test_capture_and_replay_us_give_one_sample_per_round():
    x = torch.zeros(1024, device="cuda")
    graph = timing.capture(lambda: x.add_(1), calls=3, warmup=2)
    assert x[0].item() == 2  # the warm-up calls ran, the captured ones did not
    samples = timing.replay_us(graph, calls=3, rounds=4)
    assert len(samples) == 4 and all(s > 0 for s in samples)
    assert x[0].item() == 2 + 3 * 4


@pytest.mark.gpu
def test_interleaved_device_and_eager_order_spin_kernels():
    cuda = torch.device("cuda")
    fns = {"long": lambda: torch.cuda._sleep(_LONG), "short": lambda: torch.cuda._sleep(_SHORT)}
    for how in timing.TIMINGS:
        result = timing.interleaved_us(fns, cuda, timing=how, calls=2, rounds=3)
        assert 0 < result["short"] < result["long"], how
    assert timing.eager_us(fns["long"], cuda, calls=2, rounds=2) > timing.eager_us(fns["short"], cuda, calls=2,
                                                                                   rounds=2)


@pytest.mark.gpu
def test_op_timer_on_cuda_reads_events_after_the_forward():
    timer = timing.OpTimer(torch.device("cuda"))
    timer.call("spin", "cuda", torch.cuda._sleep, (_LONG,), {})
    timer.call("spin", "cuda", torch.cuda._sleep, (_SHORT,), {})
    (_, _, long), (_, _, short) = timer.results()
    assert 0 < short < long


@pytest.mark.gpu
def test_autotune_bench_times_graph_replays_in_milliseconds_with_ordered_quantiles():
    """Triton's autotuner calls it as do_bench(fn, quantiles=(0.5, 0.2, 0.8)) and compares milliseconds."""
    x = torch.zeros(1024, device="cuda")
    long = timing.autotune_bench(lambda: torch.cuda._sleep(_LONG))
    median, low, high = timing.autotune_bench(lambda: x.add_(1), quantiles=(0.5, 0.2, 0.8))
    assert 0 < low <= median <= high < long
    assert x[0].item() == 1 + 1 + timing.AUTOTUNE_ROUNDS  # one warm-up, the upload replay, one call per round
    assert 2_000_000 / 3e9 * 1e3 < long < 100  # 2M cycles at 0.1-3 GHz: milliseconds (microseconds would be 1000s)


def test_autotune_bench_reduces_one_flushed_replay_per_round_to_the_median_and_quantiles(monkeypatch):
    """How the Triton autotuner's benchmark reduces its samples, without a GPU: the graph stood in for, the replay
    timings given (in microseconds, shuffled). One call a replay, the L2 flushed, AUTOTUNE_ROUNDS of them; the result
    in milliseconds: the median, or Triton's (0.5, 0.2, 0.8) quantiles in order."""
    import random

    captured, asked = [], []
    graph = types.SimpleNamespace(replay=lambda: asked.append("upload"))
    monkeypatch.setattr(timing, "capture", lambda fn, calls, warmup: captured.append((calls, warmup)) or graph)
    samples = [float(us) for us in range(1, timing.AUTOTUNE_ROUNDS + 1)]  # 1 .. 50 us
    random.Random(7).shuffle(samples)

    def replay_us(g, calls, rounds, *, flush_l2=False):
        assert g is graph and calls == 1 and rounds == timing.AUTOTUNE_ROUNDS and flush_l2
        return list(samples)

    monkeypatch.setattr(timing, "replay_us", replay_us)
    assert timing.autotune_bench(lambda: None) == pytest.approx(25.5e-3)  # the median of 1 .. 50 us, in ms
    median, low, high = timing.autotune_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))
    assert low < median < high and median == pytest.approx(25.5e-3)
    assert low == pytest.approx(10.8e-3) and high == pytest.approx(40.2e-3)  # inclusive percentiles of 1 .. 50
    # interpolated between neighbours, out to the extremes (clamped percentiles gave 1.49 and 49.51 us for 0 and 1)
    assert timing.autotune_bench(lambda: None, quantiles=(0.0, 1.0, 0.125)) == pytest.approx([1e-3, 50e-3, 7.125e-3])
    with pytest.raises(ValueError, match="(?i)quantile"):
        timing.autotune_bench(lambda: None, quantiles=(1.5,))
    assert captured == [(1, 1)] * 4 and asked == ["upload"] * 4
