"""bench.single_latency: the real server with a stubbed forward answers, and the split it reports is consistent."""

from __future__ import annotations

from bench.single_latency import measure


def test_single_request_split_is_consistent():
    report = measure(forward_ms=2.0, count=12)
    for client in ("httpx", "http_client"):
        r = report[client]
        # a request waits at least for the forward's stand-in; /healthz does not
        assert r["infer_p50_ms"] >= 2.0 > r["healthz_p50_ms"] > 0, (client, r)
        assert r["infer_p50_ms"] <= r["infer_p99_ms"]
