"""server.wire: a tick's requests and replies survive the trip between processes exactly (ids, lengths, pair
starts, shaping, deadlines; rows bit for bit; each error as its own class and status), and frames that do not add
up are refused."""

from __future__ import annotations

import numpy as np
import pytest

from fusedserve.model.api import Rows
from fusedserve.server import errors, wire

rng = np.random.default_rng()


def _rows(count: int, pairs: bool = False) -> Rows:
    lengths = rng.integers(1, 700, size=count)
    rows = [rng.integers(0, 250_000, size=n).tolist() for n in lengths]
    second = [int(rng.integers(0, n + 1)) for n in lengths] if pairs else None
    return Rows.of(rows, second)


def _frames_as_received(frames):
    """What a socket hands the other side: each frame's bytes, no longer the sender's arrays."""
    return [bytes(f) for f in frames]


def test_requests_round_trip():
    requests = [(2**63 + 5, 0, _rows(1), False, None, 123.25, "pooled"),
                (7, 3, _rows(7, pairs=True), True, 384, 9.5, "sparse"),
                (8, 1, _rows(300), True, None, 1e9, "tokens"), (9, 0, _rows(3, pairs=True), False, 1, 0.0, "tokens")]
    submits, cancels = wire.unpack_requests(_frames_as_received(wire.pack_requests(requests, cancels=[4, 2**64 - 1])))
    assert cancels.tolist() == [4, 2**64 - 1]
    assert len(submits) == len(requests)
    for s, (rid, model, rows, normalize, dimensions, deadline, output) in zip(submits, requests):
        assert (s.id, s.model, s.normalize, s.dimensions, s.deadline, s.output) == \
            (rid, model, normalize, dimensions, deadline, output)
        assert s.rows.ids.dtype == np.int64 and s.rows.lengths.dtype == np.int64
        assert np.array_equal(s.rows.ids, rows.ids) and np.array_equal(s.rows.lengths, rows.lengths)
        assert (s.rows.second is None) == (rows.second is None)
        if rows.second is not None:
            assert np.array_equal(s.rows.second, rows.second)


def test_a_tick_of_only_cancels_or_nothing():
    assert wire.unpack_requests(_frames_as_received(wire.pack_requests([], cancels=[1])))[0] == []
    submits, cancels = wire.unpack_requests(_frames_as_received(wire.pack_requests([])))
    assert submits == [] and cancels.tolist() == []


def test_replies_round_trip_rows_and_errors():
    blocks = [rng.standard_normal((n, w)).astype(np.float32) for n, w in ((1, 384), (7, 1023), (300, 1), (2, 769))]
    blocks[1][3, 5] = -0.0
    answers = [wire.Answer(10, blocks[0], None, 1.0, 2.0, 3.0),
               wire.Answer(11, None, errors.Timeout("not served within 30s"), 1.5, None, None),
               wire.Answer(12, blocks[1], None, 4.0, 5.0, 6.0),
               wire.Answer(13, None, errors.Overloaded("queue full", headers={"Retry-After": "1"}), None, None, None),
               wire.Answer(14, blocks[2], None, 7.0, 8.0, 9.0),
               wire.Answer(15, None, errors.Unprocessable("bad prompt", param="prompt_name"), None, None, None),
               wire.Answer(16, blocks[3], None, 1.0, 1.0, 1.0)]
    back = wire.unpack_replies(_frames_as_received(wire.pack_replies(answers)))
    assert [a.id for a in back] == [a.id for a in answers]
    for got, sent in zip(back, answers):
        assert (got.enqueued, got.started, got.done) == (sent.enqueued, sent.started, sent.done)
        if sent.error is None:
            assert got.error is None and got.rows.shape == sent.rows.shape
            assert got.rows.tobytes() == sent.rows.tobytes()  # bit for bit, -0.0 included
        else:
            assert type(got.error) is type(sent.error) and got.rows is None
            assert (got.error.status, got.error.type, got.error.message, got.error.headers, got.error.param) == \
                (sent.error.status, sent.error.type, sent.error.message, sent.error.headers, sent.error.param)


def test_frames_that_do_not_add_up_are_refused():
    frames = _frames_as_received(wire.pack_requests([(1, 0, _rows(3), False, None, 1.0, "pooled")]))
    with pytest.raises(ValueError, match="5 frames"):
        wire.unpack_requests(frames[:4])
    with pytest.raises(ValueError, match="do not add up"):
        wire.unpack_requests([frames[0], frames[1], frames[2][:-4], frames[3], frames[4]])
    with pytest.raises(ValueError, match="pair starts"):
        wire.unpack_requests([frames[0], frames[1], frames[2], np.zeros(3, "<i4").tobytes(), frames[4]])
    with pytest.raises(ValueError, match="outside int32"):
        wire.pack_requests([(1, 0, Rows.of([[2**31]]), False, None, 1.0, "pooled")])
    replies = _frames_as_received(wire.pack_replies([wire.Answer(1, np.ones((2, 3), np.float32), None, 0, 0, 0)]))
    with pytest.raises(ValueError, match="shorter"):
        wire.unpack_replies([replies[0], replies[1][:-4], replies[2]])


def test_every_service_error_crosses_as_its_own_class():
    """Every error class server.errors defines (what the engine's checks and the batcher raise) comes back as that
    class; a subclass defined elsewhere comes back as its status's class, with its own status and type."""
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ServiceError)]

    class Elsewhere(errors.Unavailable):
        type = "elsewhere"

    answers = [wire.Answer(i, None, cls(f"message {i}"), None, None, None) for i, cls in enumerate(classes)]
    answers.append(wire.Answer(len(classes), None, Elsewhere("gone"), None, None, None))
    back = wire.unpack_replies(_frames_as_received(wire.pack_replies(answers)))
    for got, cls in zip(back, classes):
        assert type(got.error) is cls and got.error.status == cls.status and got.error.type == cls.type
    assert type(back[-1].error) is errors.Unavailable and back[-1].error.type == "elsewhere"
    assert back[-1].error.status == 503 and back[-1].error.message == "gone"
