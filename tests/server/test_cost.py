"""The cost model of admission (server.cost) on synthetic timings: the fit recovers a known model from its probe shapes,
stays usable under noise, keeps every coefficient >= 0 where noise makes a term look negative, and admit() refuses
exactly what is predicted past the time left."""

from __future__ import annotations

import numpy as np
import pytest

from fusedserve.model.api import Rows
from fusedserve.server.cost import CostModel, features, fit, overdue_middle, probe_shapes
from fusedserve.server.errors import PayloadTooLarge

# a base-size encoder on a small CPU: 80 ms per launch, 1.7 ms per token, 0.3 us per token^2 of attention
TRUE = (0.08, 1.7e-3, 3.0e-7)


def timed(shapes, coef=TRUE, noise=None):
    """(lengths, seconds) per (rows, length) shape, each time scaled by its entry of `noise` (1 + relative error)."""
    samples = []
    for i, (rows, length) in enumerate(shapes):
        lengths = np.full(rows, length)
        seconds = float(features(lengths) @ np.array(coef))
        samples.append((lengths, seconds * (1.0 if noise is None else noise[i])))
    return samples


def test_probe_shapes_separate_the_terms():
    assert probe_shapes(8192) == [(1, 16), (1, 512), (1, 2048)]
    assert probe_shapes(256) == [(1, 16), (1, 64), (1, 256)]
    for longest in (8192, 512, 300, 256, 128, 64, 20, 8, 1):
        shapes = probe_shapes(longest)
        assert all(rows >= 1 and 1 <= length <= longest for rows, length in shapes), longest
    # three lengths: the fixed, linear and quadratic terms are told apart
    x = np.array([features(np.full(rows, length)) for rows, length in probe_shapes(8192)])
    assert np.linalg.matrix_rank(x) == 3


def test_fit_recovers_exact_timings():
    a, b, c = fit(timed(probe_shapes(8192)))
    assert a == pytest.approx(TRUE[0], rel=1e-6)
    assert b == pytest.approx(TRUE[1], rel=1e-6)
    assert c == pytest.approx(TRUE[2], rel=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_fit_under_noise_predicts_long_inputs_within_bounds(seed):
    # every probe off by up to 5% either way: the 8192-token input, four times the longest probe, is still predicted
    # within a third of its true time, and both ways of a 30 s deadline are told apart where they are far apart
    rng = np.random.default_rng(seed)
    shapes = probe_shapes(8192)
    a, b, c = fit(timed(shapes, noise=rng.uniform(0.95, 1.05, len(shapes))))
    assert min(a, b, c) >= 0
    model = CostModel("cpu", a, b, c, max_batch_tokens=2048, max_batch_requests=64)
    truth = CostModel("cpu", *TRUE, max_batch_tokens=2048, max_batch_requests=64)
    for length in (16, 512, 2048, 8192):
        assert model.predict([length]) == pytest.approx(truth.predict([length]), rel=0.34), length


def test_a_negative_slope_is_clamped_at_zero():
    # the long input timed faster than the same tokens in short rows (a disturbed run of the rows): attention looks
    # negative; the fit keeps it at 0 and still fits the rest, so no prediction goes down as an input grows
    shapes = probe_shapes(8192)
    samples = timed(shapes, noise=[1.0, 1.6, 1.0])
    assert np.linalg.lstsq(np.array([features(x) for x, _ in samples]), [t for _, t in samples],
                           rcond=None)[0][2] < 0  # unconstrained, the quadratic term goes negative
    a, b, c = fit(samples)
    assert c == 0 and a >= 0 and b > 0
    model = CostModel("cpu", a, b, c, 2048, 64)
    predictions = [model.predict([n]) for n in (1, 16, 64, 512, 2048, 8192)]
    assert predictions == sorted(predictions) and predictions[0] >= 0


def test_a_short_input_slower_than_long_ones_keeps_every_term_non_negative():
    # a disturbed short probe: taken at face value the per-token term would be negative
    samples = [(np.array([16]), 0.9), (np.full(32, 64), 0.5), (np.array([2048]), 0.6)]
    a, b, c = fit(samples)
    assert min(a, b, c) >= 0
    assert CostModel("cpu", a, b, c, 2048, 64).predict([8192]) >= CostModel("cpu", a, b, c, 2048, 64).predict([16])


def test_fit_of_one_shape_or_equal_times():
    a, b, c = fit([(np.array([16]), 0.01)])
    assert min(a, b, c) >= 0 and features([16]) @ np.array([a, b, c]) == pytest.approx(0.01)
    a, b, c = fit(timed([(1, 8), (1, 8), (1, 8)]))  # a model shorter than every probe: one shape, thrice
    assert min(a, b, c) >= 0 and features([8]) @ np.array([a, b, c]) == pytest.approx(features([8]) @ TRUE)
    with pytest.raises(ValueError):
        fit([])


def test_predict_counts_a_batch_per_limit():
    model = CostModel("cpu", 1.0, 0.0, 0.0, max_batch_tokens=100, max_batch_requests=4)
    assert model.predict([10]) == 1.0
    assert model.predict([10] * 9) == 3.0      # 9 inputs, 4 per batch
    assert model.predict([60, 60, 60]) == 2.0  # 180 tokens, 100 per batch
    assert CostModel("cpu", 0.0, 1e-3, 1e-6, 2048, 64).predict([100, 100]) == pytest.approx(0.2 + 0.02)


def test_admit_refuses_only_past_the_time_left():
    model = CostModel("cpu", 0.0, 1e-3, 0.0, 2048, 64)  # 1 ms per token
    model.admit(Rows.of([[1] * 1000]), left_s=1.5, timeout_s=2.0)
    model.admit(Rows.of([[1] * 2000]), left_s=2.0, timeout_s=2.0)  # predicted to end just as the deadline does
    with pytest.raises(PayloadTooLarge) as refused:
        model.admit(Rows.of([[1] * 2100]), left_s=2.0, timeout_s=2.0)
    assert refused.value.status == 413
    assert refused.value.message == ("1 input of 2100 tokens predicted to run 2.1s on cpu, over the request deadline "
                                     "(request_timeout_s=2); send shorter or fewer inputs")
    with pytest.raises(PayloadTooLarge) as refused:  # part of the deadline went on reading and tokenizing
        model.admit(Rows.of([[1] * 500, [1] * 500]), left_s=0.5, timeout_s=30.0)
    assert "2 inputs of 1000 tokens predicted to run 1.0s on cpu, over the 0.5s left of the request deadline " \
        "(request_timeout_s=30)" in refused.value.message


def test_admit_never_refuses_for_the_fixed_cost_alone():
    # a launch slower than the whole deadline (a slow device, or a fit disturbed by another process): a small request
    # is not "too large", whatever its prediction; what grows with the request is still compared
    model = CostModel("cpu", 5.0, 1e-3, 0.0, 2048, 64)
    model.admit(Rows.of([[1] * 16]), left_s=1.0, timeout_s=1.0)
    with pytest.raises(PayloadTooLarge, match=r"predicted to run 7\.0s"):
        model.admit(Rows.of([[1] * 2000]), left_s=1.0, timeout_s=1.0)


def test_a_slowed_middle_probe_is_told_apart():
    lengths = [length for _, length in probe_shapes(8192)]
    exact = [seconds for _, seconds in timed(probe_shapes(8192))]
    assert not overdue_middle(lengths, exact)
    # the middle run nearly twice as slow: above the line through the others, so measure() times it again
    assert overdue_middle(lengths, [exact[0], exact[1] * 1.8, exact[2]])
    # a slowed long or short run bends the curve up: nothing to time again (it errs high)
    assert not overdue_middle(lengths, [exact[0], exact[1], exact[2] * 1.5])
    assert not overdue_middle(lengths, [exact[0] * 3, exact[1], exact[2]])
    assert not overdue_middle([8, 8, 8], [0.1, 0.2, 0.1])  # a model shorter than every probe: one length
