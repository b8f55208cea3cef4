"""The engine (server.engine) in its own process, fed by front-end clients (server.engine_client) over its socket:
requests of several clients share its batches and each gets its own rows; the engine's refusals arrive as the
errors the front-end answers with; a cancelled request's answer never lands; a message that is not a front-end's
does not stop it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
import zmq

from fusedserve.model import text_side
from fusedserve.model.api import Description, Rows, TextOptions
from fusedserve.server import errors
from fusedserve.server.engine import REQUESTS
from fusedserve.server.engine_client import EngineClient
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close

START_S = 300  # the engine loads and warms up the tiny preset on a loaded 2-core machine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    address = f"ipc://{folder}/engine.sock"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_")},
           "FUSEDSERVE_MODEL": "tiny", "FUSEDSERVE_DEVICE": "cpu", "FUSEDSERVE_MAX_BATCH_TOKENS": "512"}
    env.pop("TRITON_INTERPRET", None)
    log = (folder / "engine.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "fusedserve.server.engine", "--address", address],
                               cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield address, process
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()
    print((folder / "engine.log").read_text()[-3000:])


def _side(description: dict):
    return text_side(Description.from_json(description["models"][0]["description"]).text)


def _run(engine, scenario, clients: int = 1):
    address, process = engine

    async def main():
        connected = [EngineClient(address) for _ in range(clients)]
        for c in connected:
            c.start()
        try:
            description = await asyncio.wait_for(connected[0].describe(), START_S)
            return await scenario(connected, description)
        finally:
            for c in connected:
                c.close()

    assert process.poll() is None, "the engine exited"
    return asyncio.run(main())


def test_the_engine_describes_its_models_and_their_text_side(engine):
    async def scenario(clients, description):
        return description

    description = _run(engine, scenario)
    (model,) = description["models"]
    described = Description.from_json(model["description"])
    assert model["name"] == "tiny" and described.kind == "embedding" and described.dim > 0
    assert described.device == "cpu" and described.kernels and described.text is not None
    side = text_side(described.text)
    rows = side.prepare(["a front-end tokenizes this"], TextOptions())
    assert len(rows) == 1 and rows.tokens > 3


def test_the_description_carries_the_calibration_of_the_engines_warm_up(engine):
    """The int8/uint8 calibration embeddings the engine computed at warm-up travel in its description, so front-ends
    quantize with them and run no calibration forward of their own (server.calibration)."""
    from fusedserve.model import load
    from fusedserve.model.api import LoadOptions
    from fusedserve.server.calibration import Calibration, embeddings_from_json
    from fusedserve.server.quantize import CALIBRATION_TEXTS

    async def scenario(clients, description):
        return description

    (model,) = _run(engine, scenario)["models"]
    shipped = embeddings_from_json(model["calibration"])
    local = load("tiny", LoadOptions(device="cpu", max_batch_tokens=512))
    expected = Calibration(local, None, 64).embed()  # as the engine's warm-up computes them (no batcher needed)
    assert shipped.dtype == np.float32
    assert shipped.shape == expected.shape == (len(CALIBRATION_TEXTS), local.describe().dim)
    assert_embeddings_close(shipped, expected, what="the engine's calibration embeddings vs the model in-process")


def test_requests_of_several_clients_share_batches_and_get_their_own_rows(engine):
    texts = SENTENCES[:48]

    async def scenario(clients, description):
        side = _side(description)
        prepared = [side.prepare([t], TextOptions()) for t in texts]
        alone = [await clients[0].submit(0, rows, 30).future for rows in prepared]  # one at a time
        jobs = [clients[i % len(clients)].submit(0, rows, 30) for i, rows in enumerate(prepared)]
        together = await asyncio.gather(*(j.future for j in jobs))
        many = Rows.gather([(rows, 0) for rows in prepared[:7]])
        shaped = await clients[1].submit(0, many, 30, normalize=True, dimensions=8).future
        return alone, together, jobs, shaped

    alone, together, jobs, shaped = _run(engine, scenario, clients=3)
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a.shape == t.shape == (1, alone[0].shape[1])
        assert_embeddings_close(t, a, what=f"input {i} among every client's requests vs alone")
    assert all(j.enqueued is not None and j.started is not None and j.done >= j.started for j in jobs)
    assert shaped.shape == (7, 8)
    np.testing.assert_allclose(np.linalg.norm(shaped, axis=1), 1.0, rtol=1e-5)
    for i in range(7):
        head = alone[i][0, :8] / np.linalg.norm(alone[i][0, :8])
        assert_embeddings_close(shaped[i], head, what=f"normalized first 8 dimensions of input {i}")


def test_per_token_rows_come_back_as_the_models_own(engine):
    """A per-token request (/embed_all's): every token's row, [tokens, width], as the same model computes them."""
    from fusedserve.model import load
    from fusedserve.model.api import LoadOptions

    texts = ["per token", SENTENCES[3], "x"]

    async def scenario(clients, description):
        rows = _side(description).prepare(texts, TextOptions())
        return rows, await clients[0].submit(0, rows, 30, output="tokens").future

    rows, block = _run(engine, scenario)
    local = load("tiny", LoadOptions(device="cpu", max_batch_tokens=512))
    expected = local.launch(rows, output="tokens").rows()
    assert block.shape == expected.shape == (rows.tokens, expected.shape[1])
    assert_embeddings_close(block, expected, what="per-token rows through the engine vs the model in-process")


def test_refusals_arrive_as_the_errors_the_front_end_answers_with(engine):
    async def scenario(clients, description):
        client = clients[0]
        rows = Rows.of([[1, 5, 6, 2]])
        outcomes = []
        for model, timeout in ((0, -1.0), (7, 30.0)):
            try:
                await client.submit(model, rows, timeout).future
            except errors.ServiceError as exc:
                outcomes.append(exc)
        return outcomes

    expired, unknown = _run(engine, scenario)
    assert isinstance(expired, errors.Timeout) and expired.status == 504
    assert isinstance(unknown, errors.NotFound) and "model index 7" in unknown.message


def test_a_cancelled_request_is_never_answered_and_the_next_ones_are(engine):
    async def scenario(clients, description):
        client = clients[0]
        side = _side(description)
        rows = side.prepare(SENTENCES[:32], TextOptions())
        gone = client.submit(0, rows, 30)
        client.cancel(gone)
        after = await client.submit(0, side.prepare(["still answered"], TextOptions()), 30).future
        await asyncio.sleep(0.5)  # the cancelled one's answer, had it been sent, arrives within this on loopback
        return gone, after, client.in_flight

    gone, after, in_flight = _run(engine, scenario)
    assert not gone.future.done() and after.shape[0] == 1 and in_flight == 0


def test_a_message_that_is_not_a_front_ends_does_not_stop_the_engine(engine):
    address, process = engine
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send_multipart([REQUESTS, b"\x00" * 7, b"junk"])
    socket.send_multipart([b"nonsense"])
    socket.close()

    async def scenario(clients, description):
        return await clients[0].submit(0, Rows.of([[1, 5, 6, 2]]), 30).future

    assert _run(engine, scenario).shape[0] == 1
    assert process.poll() is None
