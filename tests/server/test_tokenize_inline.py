"""A lone request of short inputs is tokenized on the event loop (a thread hop costs more than the tokenizer); long
inputs, and every request while others are being served, on worker threads, the requests of one loop tick together
(server.model_service.TickPreparer); either way the token ids and the embeddings are those of each request prepared
alone, and a request's error is its own."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from fusedserve.model.api import TextOptions
from fusedserve.server.config import Settings
from fusedserve.server.errors import PayloadTooLarge, Unprocessable
from fusedserve.server.model_service import INLINE_TOKENIZE_CHARS, PREPARE_CHUNK_CHARS, TickPreparer
from fusedserve.server.service import Service
from tests.tolerances import assert_embeddings_close
from tests.waiting import wait_until_async


class _Connected:
    """A request whose client stays: its next ASGI message never comes."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()


@pytest.fixture(scope="module")
def server():
    server = Service(Settings(model="tiny", device="cpu", max_wait_ms=0, warmup=False))
    server.load()
    server.mark_ready()
    yield server
    server.shutdown()


@pytest.fixture
def hops(monkeypatch):
    """The thread calls TickPreparer makes, each the list of requests' inputs it prepared."""
    calls = []
    original = TickPreparer._run

    def counting(self, loop, chunk):
        calls.append([item[0] for item in chunk])
        return original(self, loop, chunk)

    monkeypatch.setattr(TickPreparer, "_run", counting)
    return calls


# long words the tokenizer keeps whole: a text over INLINE_TOKENIZE_CHARS characters in fewer than max_seq_length tokens
WORDS = ("international", "understanding", "information", "development", "environment", "government",
         "performance", "particularly", "relationship", "significant", "professional", "organization")


def _long(seed: int, words: int = INLINE_TOKENIZE_CHARS // 10 + 1) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words))


def test_short_inputs_skip_the_thread_hop(server, hops):
    svc = server.default
    short = ["a short sentence"]
    long_ = [_long(0)]

    async def embed(texts):
        return await svc.embed(texts, TextOptions(), _Connected())

    a = asyncio.run(embed(short))
    assert hops == []
    b = asyncio.run(embed(long_))
    assert len(hops) == 1
    embedder = svc.model.embedder  # the test's oracle reaches past the seam
    assert_embeddings_close(a.rows, embedder.embed(short, normalize=False))
    assert_embeddings_close(b.rows, embedder.embed(long_, normalize=False))


def test_short_inputs_under_load_go_to_the_threads(server, hops):
    svc = server.default
    busy, gate = threading.Event(), threading.Event()
    # the batcher busy: requests wait for it
    held = svc.batcher.between_batches(lambda: (busy.set(), gate.wait(30)))
    first, second = ["the first short sentence"], ["another short sentence"]

    async def two():
        assert await asyncio.to_thread(busy.wait, 30), "the batcher never took the work that holds it"
        waiting = asyncio.create_task(svc.embed(first, TextOptions(), _Connected()))
        # the first is with the batcher now (prepared here: nothing else was served)
        await wait_until_async(lambda: svc.batcher.queue_depth == len(first) or waiting.done(), 30,
                               "the first request never reached the batcher's queue")
        assert not waiting.done(), waiting
        assert hops == []
        rows = await svc.prepare(second)  # one request is being served: this one is prepared on a thread
        assert hops == [[second]]
        gate.set()
        return (await waiting).rows, rows

    try:
        a, second_rows = asyncio.run(two())
    finally:
        gate.set()
        held.result(timeout=30)
    assert second_rows.tolist() == svc.model.prepare(second, TextOptions()).tolist()
    assert_embeddings_close(a, svc.model.embedder.embed(first, normalize=False))


def test_one_tick_of_requests_is_one_thread_call_with_each_requests_own_rows(server, hops):
    svc = server.default
    requests = [[_long(i)] for i in range(5)] + [[_long(10), _long(11, 40), _long(12)]]
    uncut = [_long(20), _long(21)]  # other options: their own group, in the same call

    async def prepare_all():
        return await asyncio.gather(*(svc.prepare(texts) for texts in requests),
                                    svc.prepare(uncut, TextOptions(truncate=False)))

    got = asyncio.run(prepare_all())
    assert len(hops) == 1 and len(hops[0]) == len(requests) + 1
    for texts, rows in zip(requests + [uncut], got):
        alone = svc.model.prepare(texts, TextOptions())
        assert rows.tolist() == alone.tolist()


def test_a_bad_request_in_a_tick_fails_alone(server, hops):
    svc = server.default
    limit = svc.model.describe().max_length
    good = [_long(1)]
    too_long = [_long(2), _long(3, words=limit + 50)]  # its second input is over max_seq_length
    unpaired = [_long(4) + "\ud800"]  # a lone surrogate: not text the tokenizer takes

    async def prepare_all():
        return await asyncio.gather(svc.prepare(good, TextOptions(truncate=False)),
                                    svc.prepare(too_long, TextOptions(truncate=False)),
                                    svc.prepare(unpaired, TextOptions(truncate=False)), return_exceptions=True)

    ok, long_error, text_error = asyncio.run(prepare_all())
    assert len(hops) == 1
    assert ok.tolist() == svc.model.prepare(good, TextOptions()).tolist()
    assert isinstance(long_error, PayloadTooLarge) and "input 1 " in str(long_error), long_error
    assert isinstance(text_error, Unprocessable), text_error


def test_a_tick_over_the_chunk_size_is_several_calls(server, hops):
    svc = server.default
    per_request = 4 * INLINE_TOKENIZE_CHARS  # characters
    count = 2 * PREPARE_CHUNK_CHARS // per_request + 1
    requests = [[_long(i, words=per_request // 10)] for i in range(count)]

    async def prepare_all():
        return await asyncio.gather(*(svc.prepare(texts) for texts in requests))

    got = asyncio.run(prepare_all())
    assert len(hops) >= 3 and sum(map(len, hops)) == count
    for texts, rows in zip(requests, got):
        assert rows.tolist() == svc.model.prepare(texts, TextOptions()).tolist()
