"""A front-end's view of an engine's connection (server.engine_client.EngineClient.connected): its two sources, the
socket monitor's events and the engine's DESCRIPTION messages, race, and the rule is one of a latch whatever their
order: connected from the first of a handshake or a description, disconnected by a disconnect of a standing
connection only, whose jobs in flight fail once; a handshake after a disconnect asks the new engine to describe."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
import zmq.asyncio

from fusedserve.model.api import Rows
from fusedserve.server.engine import DESCRIBE, DESCRIPTION
from fusedserve.server.engine_client import EngineClient
from fusedserve.server.errors import Unavailable


def _description() -> list[zmq.Frame]:
    return [zmq.Frame(DESCRIPTION), zmq.Frame(json.dumps({"models": []}).encode())]


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/engine.sock"


def test_a_description_before_the_handshake_event_connects_and_the_event_changes_nothing(address):
    async def scenario():
        client = EngineClient(address)  # the monitor is not started: the test hands it the events itself
        try:
            waiting = asyncio.ensure_future(client.describe())
            await asyncio.sleep(0)
            assert not client.connected
            client._on_message(_description())  # the engine's answer first ...
            assert client.connected and (await waiting) == {"models": []}
            await client._on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # ... then the monitor's event for its connection
            return client.connected, client.disconnects
        finally:
            client.close()

    assert asyncio.run(scenario()) == (True, 0)


def test_a_disconnect_fails_the_jobs_in_flight_once_and_a_new_handshake_asks_for_a_description(address):
    async def scenario():
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        client = EngineClient(address)
        try:
            await client._on_event(zmq.EVENT_DISCONNECTED)  # not connected yet: nothing is lost
            assert not client.connected and client.disconnects == 0
            await client._on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # the first engine
            job = client.submit(0, Rows.of([[1, 5, 2]]), 30)
            await client._on_event(zmq.EVENT_DISCONNECTED)
            await client._on_event(zmq.EVENT_DISCONNECTED)  # a second event of the same loss counts no second
            with pytest.raises(Unavailable):
                await job.future
            lost = (client.connected, client.disconnects, client.in_flight)
            await client._on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # a new engine
            while True:  # the requests message of the failed job, then the describe of the new connection
                frames = await asyncio.wait_for(router.recv_multipart(), 10)
                if frames[1] == DESCRIBE:
                    break
            return lost, client.connected
        finally:
            client.close()
            router.close()

    lost, connected = asyncio.run(scenario())
    assert lost == (False, 1, 0) and connected
