"""bench.single_latency: the real server with a stubbed forward answers, and the split it reports is consistent."""

from __future__ import annotations

from bench.single_latency import measure, measure_load


def test_single_request_split_is_consistent():
    report = measure(forward_ms=2.0, count=12)
    for client in ("httpx", "http_client"):
        r = report[client]
        # a request waits at least for the forward's stand-in; /healthz does not
        assert r["infer_p50_ms"] >= 2.0 > r["healthz_p50_ms"] > 0, (client, r)
        assert r["infer_p50_ms"] <= r["infer_p99_ms"]


def test_stub_load_counts_every_request_and_the_servers_cpu():
    report = measure_load(clients=4, rate=2e6, seconds=1.5, per_request=4, texts=64)
    s = report["server"]
    assert report["errors"] == 0 and report["requests"] > 4
    assert s["requests"] == report["requests"]  # the server counted each answered request once
    assert round(s["inputs_per_batch"] * s["batches"]) == 4 * report["requests"]
    # the stand-in device runs tokens / rate per batch: the served rate cannot pass it
    assert 0 < report["tokens_per_s"] <= 2e6
    assert 0 < s["cpu_ms_per_request"] and report["cpu_bound_requests_per_s"] == 1e3 / s["cpu_ms_per_request"]
