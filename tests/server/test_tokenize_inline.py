"""Short inputs are tokenized on the event loop (a thread hop costs more than the tokenizer), long ones in a
worker thread; either way the embeddings are the same."""

from __future__ import annotations

import asyncio

from fusedserve.model.api import TextOptions
from fusedserve.server import model_service as service_module
from fusedserve.server.config import Settings
from fusedserve.server.model_service import INLINE_TOKENIZE_CHARS
from fusedserve.server.service import Service
from tests.tolerances import assert_embeddings_close


class _Connected:
    """A request whose client stays: its next ASGI message never comes."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()


def test_short_inputs_skip_the_thread_hop(monkeypatch):
    hops = []
    original = asyncio.to_thread

    async def counting_to_thread(fn, *args, **kwargs):
        hops.append(fn)
        return await original(fn, *args, **kwargs)

    monkeypatch.setattr(service_module.asyncio, "to_thread", counting_to_thread)
    server = Service(Settings(model="tiny", device="cpu", max_wait_ms=0, warmup=False))
    server.load()
    server.mark_ready()
    svc = server.default
    short = ["a short sentence"]
    long_ = ["word " * (INLINE_TOKENIZE_CHARS // 5 + 1)]

    async def embed(texts):
        return await svc.embed(texts, TextOptions(), _Connected())

    try:
        a = asyncio.run(embed(short))
        assert hops == []
        b = asyncio.run(embed(long_))
        assert len(hops) == 1
        embedder = svc.model.embedder  # the test's oracle reaches past the seam
        assert_embeddings_close(a.rows, embedder.embed(short, normalize=False))
        assert_embeddings_close(b.rows, embedder.embed(long_, normalize=False))
    finally:
        server.shutdown()
