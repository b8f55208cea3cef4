"""Admission by predicted cost: a request whose forward is predicted to outlast the time left of its deadline is
refused (413) before any of it runs. A forward cannot be stopped once it runs, and on a CPU one layer of a long input
can outlast a whole deadline, so the request past its deadline would be answered 504 while the worker went on
computing it and every request behind it waited.

The prediction is a cost model fit at warm-up on the model's own device (ModelService.warm_up):

    time(rows) = a * batches + b * tokens + c * sum(length^2)

a: a launch's fixed cost (per batch the batcher will cut the request into), b: the per-token work (the GEMMs, the
MLP), c: attention, quadratic in each input's length. It is fit from three single inputs (probe_shapes): a short one
(mostly a), one a quarter as long as the longest (mostly b) and the longest (its attention a large share of its time:
c from the curvature). Each coefficient is kept >= 0 (fit). On a CPU attention grows faster than its quadratic term
once its scores leave the caches, so for inputs much longer than the longest probe the prediction errs low: the refusal
is for what cannot finish, and the rest keeps its 504.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusedserve.model.api import Rows, ServedModel, TextOptions
from fusedserve.server.errors import PayloadTooLarge

# the probe shapes (probe_shapes): SHORT tokens, 1/QUARTER of the long input, and the long input of up to LONG tokens.
# LONG: long enough for attention to show beside the linear work of a base-size model on a CPU (a fit that cannot see
# it predicts long inputs far too low), short enough that the probes stay a small share of the warm-up. One row each:
# rows of short inputs would tell the linear term apart as well, but each row adds its own small ops, which another
# process's load on the CPU slows far more than a long input's few large ones, and a fit from rows can read their lost
# time as linear work and attention as none.
SHORT, LONG, QUARTER = 16, 2048, 4
# each shape's time is its fastest run (measure): a run another process slowed says nothing of the model
SHAPE_BUDGET_S, SLOW_RUN_S, MAX_RUNS = 0.1, 1.0, 8


@dataclass(frozen=True)
class CostModel:
    """Seconds a request's forward is predicted to take on `device`; the batch limits say how many batches the batcher
    cuts a request into (each pays the fixed cost)."""

    device: str
    fixed_s: float     # a: per batch
    token_s: float     # b: per token
    square_s: float    # c: per sum(length^2), attention
    max_batch_tokens: int
    max_batch_requests: int
    probes: tuple[tuple[int, int, float], ...] = ()  # (rows, length, seconds) the fit was made from, for the log

    def predict(self, lengths: np.ndarray) -> float:
        lengths = np.asarray(lengths, dtype=np.float64)
        tokens = float(lengths.sum())
        batches = max(1, math.ceil(len(lengths) / self.max_batch_requests),
                      math.ceil(tokens / self.max_batch_tokens))
        return self.fixed_s * batches + self.token_s * tokens + self.square_s * float((lengths * lengths).sum())

    def admit(self, rows: Rows, left_s: float, timeout_s: float) -> None:
        """Raises PayloadTooLarge where `rows` are predicted to run longer than the `left_s` seconds left of the
        request's deadline (request_timeout_s = `timeout_s`). The refusal is for the request's size: one batch's fixed
        cost, which the smallest request pays too, is left out of the comparison, so a device too slow (or a fit too
        disturbed) for even that refuses nothing as too large; its requests get the 504 they got without the model."""
        predicted = self.predict(rows.lengths)
        if predicted - self.fixed_s > left_s:
            inputs = f"{len(rows)} input{'s' if len(rows) != 1 else ''} of {rows.tokens} tokens"
            left = "" if left_s >= timeout_s - 0.05 else f"the {left_s:.1f}s left of "
            raise PayloadTooLarge(f"{inputs} predicted to run {predicted:.1f}s on {self.device}, over {left}the "
                                  f"request deadline (request_timeout_s={timeout_s:g}); send shorter or fewer inputs")

    def __str__(self) -> str:
        timed = ", ".join(f"{rows}x{length} tokens {seconds:.3g}s" for rows, length, seconds in self.probes)
        return (f"{self.fixed_s * 1e3:.3g} ms per batch + {self.token_s * 1e6:.3g} us per token + "
                f"{self.square_s * 1e9:.3g} ns per token^2 of each input (attention) on {self.device}"
                + (f" (timed: {timed})" if timed else ""))


def features(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """One batch's terms of the model: [1, tokens, sum(length^2)]."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return np.array([1.0, lengths.sum(), (lengths * lengths).sum()])


def fit(samples: Sequence[tuple[Sequence[int] | np.ndarray, float]]) -> tuple[float, float, float]:
    """(a, b, c) >= 0 from (a batch's input lengths, its seconds) samples: non-negative least squares of the
    relative error (the shapes' times differ by orders of magnitude; each should be predicted as well as the
    others). With three coefficients the exact solution is the best of the least-squares fits over each subset of
    them with the rest at 0 whose coefficients all come out >= 0 (the optimum is the plain fit on its own support),
    so no solver library is needed."""
    if not samples:
        raise ValueError("no timed samples to fit")
    x = np.array([features(lengths) for lengths, _ in samples])
    t = np.array([seconds for _, seconds in samples], dtype=np.float64)
    weight = 1.0 / np.maximum(t, 1e-9)
    x, t = x * weight[:, None], t * weight
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # the terms differ by up to 1e8: conditioned before solving
    x = x / scale
    best, best_error = np.zeros(3), float(np.sum(t * t))
    for size in (1, 2, 3):
        for support in itertools.combinations(range(3), size):
            coef = np.zeros(3)
            coef[list(support)] = np.linalg.lstsq(x[:, support], t, rcond=None)[0]
            if (coef < 0).any():
                continue
            error = float(np.sum((x @ coef - t) ** 2))
            if error < best_error - 1e-12 * best_error:
                best, best_error = coef, error
    a, b, c = (best / scale).tolist()
    return a, b, c


def probe_shapes(longest: int) -> list[tuple[int, int]]:
    """(rows, length) of each timed batch for a model whose inputs hold up to `longest` tokens: one input each of
    SHORT tokens, of a quarter of the long input's and of the long input's, the most LONG and `longest` allow."""
    long = min(LONG, longest)
    return [(1, min(SHORT, long)), (1, max(long // QUARTER, 1)), (1, long)]


def measure(model: ServedModel) -> list[tuple[np.ndarray, float]]:
    """Each probe shape's fastest forward (model.launch(...).rows(): on the host, so the device's work is in it), on
    the calling thread: the batcher's, between batches. Each shape runs at least twice, and again while its runs took
    under SHAPE_BUDGET_S (up to MAX_RUNS): short runs are the ones a burst of another process's work or a thread's late
    wake-up distorts most, and they cost least to repeat. The long input alone runs once where that run took over
    SLOW_RUN_S: the probes' costliest run, and so long a run already averages over such bursts (a slowed one makes
    the prediction err high, never low). Then, while the middle input's time lies above the line through the other
    two (overdue: see overdue_middle), it runs again, up to MAX_RUNS. The inputs are prefixes of one long text as the
    model's own tokenizer makes it, so every id is one the model takes (a ColBERT model's: queries)."""
    description = model.describe()
    ids = model.prepare(["warm up " * description.max_length], TextOptions()).row(0).tolist()
    shapes = probe_shapes(len(ids))
    batches = [Rows.of([ids[:length]] * rows) for rows, length in shapes]
    times: list[list[float]] = [[] for _ in shapes]
    output = "pooled" if "pooled" in description.outputs else "colbert"  # a ColBERT model's only forward

    def run(i: int) -> None:
        started = time.perf_counter()
        model.launch(batches[i], output=output).rows()
        times[i].append(time.perf_counter() - started)

    for i in range(len(shapes)):
        while not _enough(times[i], long=i == len(shapes) - 1):
            run(i)
    while overdue_middle([length for _, length in shapes], [min(t) for t in times]) and len(times[1]) < MAX_RUNS:
        run(1)
    return [(batch.lengths, min(t)) for batch, t in zip(batches, times)]


def overdue_middle(lengths: Sequence[int], seconds: Sequence[float]) -> bool:
    """Whether the middle of three single inputs' times lies above the straight line through the other two: time
    that bends down as inputs grow, which a model of c >= 0 (attention) rules out. Other work on the machine only adds
    time, so the middle run was slowed: the fit would read that as no attention at all and predict long inputs far too
    low."""
    (l0, l1, l2), (t0, t1, t2) = lengths, seconds
    if not l0 < l1 < l2:
        return False
    return t1 > t0 + (t2 - t0) * (l1 - l0) / (l2 - l0)


def _enough(times: list[float], long: bool) -> bool:
    """Whether a probe shape has run enough times (measure)."""
    if len(times) >= MAX_RUNS:
        return True
    if not times or sum(times) < SHAPE_BUDGET_S:
        return False
    return len(times) >= 2 or long and times[0] >= SLOW_RUN_S


def cost_model(model: ServedModel, max_batch_tokens: int, max_batch_requests: int) -> CostModel:
    """The model's cost model on its device, fit from measure()'s timings."""
    samples = measure(model)
    a, b, c = fit(samples)
    probes = tuple((len(lengths), int(lengths.max()), seconds) for lengths, seconds in samples)
    return CostModel(model.describe().device, a, b, c, max_batch_tokens, max_batch_requests, probes)
