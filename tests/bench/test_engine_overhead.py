"""`python -m bench.engine_overhead` end to end: a null-model engine in its own process, client processes, one
point; it asserts the accounting, never a speed."""

from __future__ import annotations

from bench import engine_overhead


def test_one_point_counts_requests_and_the_engines_cpu():
    result = engine_overhead.point(clients=1, concurrency=8, seconds=1.0)
    assert result["point"] == "1x8" and result["requests_per_s"] > 0
    assert 0 < result["engine_cpu_us_per_request"] < 1e6
