"""The serving benchmark's harness against a real server (tiny model, CPU): what the closed-loop clients count
agrees with what the server's own /metrics count over the same run, and the single-request split adds up."""

from __future__ import annotations

import os

import httpx

from bench.harness import running_servers
from bench.serve import kernel_choices, measured_load, single_requests
from fusedserve.model.tokenizer import TextTokenizer
from fusedserve.model.weights import default_model_dir


def test_load_and_single_requests_agree_with_the_servers_metrics():
    texts = ["a short sentence", "another one, a little longer than the first", "three"]
    tokens = [len(r) for r in TextTokenizer(default_model_dir(), 128).encode(texts)]
    with running_servers(1, model="tiny", device="cpu", torch_threads="1") as servers:
        url = servers[0][1]
        run, inside = measured_load(url, texts, clients=4, seconds=1.5, per_request=2, count_tokens=tokens)
        assert run["errors"] == 0 and len(run["latencies"]) > 4
        assert inside["requests"] == len(run["latencies"])  # every answered request, each once
        # every input ran once (2 per request)
        assert round(inside["inputs_per_batch"] * inside["batches"]) == 2 * len(run["latencies"])
        assert 0 < run["tokens"] <= 2 * len(run["latencies"]) * max(tokens)
        assert 0 < inside["forward_ms_per_batch"] and 0 < inside["server_request_ms"]
        # the server process's own CPU time (process_cpu_seconds_total): spent, and at most all cores for the run
        assert 0 < inside["cpu_ms_per_request"] and 0 < inside["cpu_cores"] <= os.cpu_count()

        # per op, how many servers chose each backend (from /info): the one server, counted twice
        choices = kernel_choices([url, url])
        ops = httpx.get(url + "/info").json()["kernels"]
        assert choices == {op: {choice["backend"]: 2} for op, choice in ops.items()} and "linear_bias_gelu" in choices

        single = single_requests(url, texts[:1], count=12, warm=2)
        s = single["server"]
        assert s["requests"] == 12 and s["batches"] == 12 and s["inputs_per_batch"] == 1  # one at a time
        # the server's time is part of the client's round trip, the forward part of the server's time
        assert s["forward_ms_per_batch"] <= s["server_request_ms"] <= single["mean_ms"]
        assert single["p50_ms"] <= single["p99_ms"] and single["healthz_p50_ms"] > 0
        raw = single["raw_client"]  # the same request from http.client: an embedding costs more than /healthz
        assert raw["infer_p50_ms"] <= raw["infer_p99_ms"] and raw["infer_p50_ms"] > raw["healthz_p50_ms"] > 0
