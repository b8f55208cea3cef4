"""A request's deadline (server.deadline): request_timeout_s from its arrival, the one the request path carries from
its preparing to its forward, and the same 504 wherever it runs out."""

from __future__ import annotations

import time

import pytest

from fusedserve.server.deadline import Deadline
from fusedserve.server.errors import Timeout
from fusedserve.server.observability import CURRENT, RequestRecord


def test_a_requests_deadline_counts_from_its_arrival():
    arrived = time.monotonic() - 1.5  # its body's read and tokenizing took 1.5 s
    token = CURRENT.set(RequestRecord("r", arrived))
    try:
        deadline = Deadline.of_request(2.0)
    finally:
        CURRENT.reset(token)
    assert deadline.at == arrived + 2.0
    assert 0 < deadline.left() <= 0.5


def test_outside_a_request_the_whole_timeout_is_left():
    before = time.monotonic()
    deadline = Deadline.of_request(30.0)
    assert before + 30.0 <= deadline.at <= time.monotonic() + 30.0


def test_a_passed_deadline_is_a_504_naming_the_timeout():
    with pytest.raises(Timeout) as raised:
        Deadline(time.monotonic() - 0.01, 2.5).left()
    assert raised.value.status == 504 and raised.value.message == "not served within 2.5s"
