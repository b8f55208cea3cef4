"""Admission by predicted cost (server.cost), on a real server: a request whose forward the warm-up's cost model
predicts past the time left of its deadline is refused 413 before any of it runs, so the worker is free for the next
request at once; a sentence still passes. A forward cannot be stopped once it runs: without the refusal the long
input holds the worker for its whole forward, long after its own 504."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.server.test_behaviour import metric

# nomic-bert-base (random weights) cut to 2048 tokens: its warm-up stays short on a small CPU, and an input of 2048
# tokens (the longest probe of the cost model) runs several seconds there, past a 2 s deadline
LONG_MODEL = {"model": "nomic-bert-base", "max_seq_length": 2048, "request_timeout_s": 2}
BATCHES = "fusedserve_batch_size_count"


@pytest.mark.slow  # a preset's whole start-up: its warm-up fits the cost model on inputs of up to 2048 tokens
def test_an_input_predicted_past_its_deadline_is_refused_and_the_next_request_is_served(make_server):
    server = make_server(**LONG_MODEL, ready_timeout_s=600)
    fit = re.search(r"cost model of nomic-bert-base: (.*) \(fit in", server.log())
    assert fit, server.log()
    assert re.search(r"warm-up: .*cost model \d+\.\ds", server.log())  # its phase in the start-up report
    batches = metric(server, BATCHES)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        long = client.post("/infer", json={"inputs": ["word " * 4000]})  # truncated to 2048 tokens
        refused = time.monotonic()
        # the worker is free: a sentence passes admission and is answered within 2 s of the refusal
        short = client.post("/infer", json={"inputs": ["A sentence of a few words."]})
        answered = time.monotonic()
        assert long.status_code == 413, (long.status_code, long.text, answered - refused, fit.group(1))
        error = long.json()["error"]
        assert error["type"] == "payload_too_large"
        assert re.fullmatch(r"1 input of 2048 tokens predicted to run \d+\.\ds on cpu, over (the \d+\.\ds left of )?"
                            r"the request deadline \(request_timeout_s=2\); send shorter or fewer inputs",
                            error["message"]), error["message"]
        assert short.status_code == 200, short.text
        assert answered - refused < 2.0, (answered - refused, fit.group(1))
        # the long input never ran: the sentence's batch is the only one since
        assert metric(server, BATCHES) == batches + 1
        # the OpenAI route (and every route through ModelService.run) refuses the same way, in its own error shape
        openai = client.post("/v1/embeddings", json={"input": "word " * 4000, "model": "nomic-bert-base"})
        assert openai.status_code == 413, openai.text
        assert "predicted to run" in openai.json()["error"]["message"]
