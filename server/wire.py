"""The messages between front-end processes and an engine (the process that owns a GPU's models): what a front-end
sends in one loop tick (every request it prepared meanwhile, and the cancels), and what the engine sends back in one
tick (every result that completed meanwhile). One multipart message a tick each way, whatever the number of
requests: the cost of a message is per message, not per byte, so requests are gathered, not sent one by one.

Frames are numpy buffers, read back with np.frombuffer (no pickling, no copy on the reading side): a fixed-layout
record per request, then the requests' arrays back to back. Token ids travel as int32 (every served vocabulary is
far below 2^31) and results as float32, the dtype the model answers in. Deadlines and timing stamps are
time.monotonic() values: CLOCK_MONOTONIC is one clock for every process of a host.

Request message: [HEADS, LENGTHS, IDS, SECONDS, CANCELS]
    HEADS    one REQUEST record per request: its id (the front-end's), the model's index (the engine's model list),
             its row count, how its rows are shaped (normalize, dimensions: 0 for all) and its deadline
    LENGTHS  int32, every request's rows' lengths, in request order
    IDS      int32, every row's ids back to back
    SECONDS  int32, every row's second-text start (a pair), only for requests with HAS_PAIRS; else empty
    CANCELS  uint64, ids of requests the front-end gave up on (its client left, or its deadline passed)
Reply message: [HEADS, BLOCK, ERRORS]
    HEADS    one REPLY record per request: its id, 0 or the error's status, the block's rows and width, and the
             engine's stamps (queued, first batch started, last row delivered)
    BLOCK    float32, every answered request's rows back to back
    ERRORS   JSON, one entry per failed request (its status names the error class; message, headers, param, code)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusedserve.model.api import Rows
from fusedserve.server import errors

REQUEST = np.dtype([("id", "<u8"), ("model", "<u2"), ("flags", "u1"), ("normalize", "u1"), ("rows", "<u4"),
                    ("dimensions", "<u4"), ("deadline", "<f8")])
REPLY = np.dtype([("id", "<u8"), ("status", "<u2"), ("rows", "<u4"), ("width", "<u4"), ("enqueued", "<f8"),
                  ("started", "<f8"), ("done", "<f8")])
HAS_PAIRS = 1  # flags: the request's rows carry second-text starts
# flags: what the answer holds (ModelService.output_rows): one row per input from the batches (neither flag), every
# token's row (/embed_all: [tokens, width], BGE-M3's multi-vectors [tokens - n, width]) or BGE-M3's sparse vectors
TOKENS, SPARSE = 2, 4
OUTPUTS = {"pooled": 0, "tokens": TOKENS, "sparse": SPARSE, "m3": TOKENS | SPARSE}  # m3: BGE-M3's three at once
_OUTPUT_OF = {flag: name for name, flag in OUTPUTS.items()}
NO_STAMP = -1.0  # a stamp the engine did not take (the request failed before its first batch)

# an error's status -> its class, to raise the same ServiceError on the front-end as the engine's
_ERRORS = {cls.status: cls for cls in vars(errors).values()
           if isinstance(cls, type) and issubclass(cls, errors.ServiceError)}


def error_fields(error: errors.ServiceError) -> dict:
    """A ServiceError as JSON fields (error_of takes them back)."""
    return {"status": error.status, "type": error.type, "message": error.message, "headers": dict(error.headers),
            "param": error.param, "code": error.code}


def error_of(fields: dict) -> errors.ServiceError:
    """The ServiceError error_fields wrote: the class of its status, with the status and type it was sent with."""
    error = _ERRORS.get(fields["status"], errors.ServiceError)(fields["message"], headers=fields["headers"] or None,
                                                               param=fields["param"], code=fields["code"])
    error.status, error.type = fields["status"], fields["type"]  # the engine's, where a subclass has its own
    return error


@dataclass(frozen=True)
class Submit:
    """One request as the engine receives it."""

    id: int
    model: int
    rows: Rows
    normalize: bool
    dimensions: int | None
    deadline: float
    output: str = "pooled"  # OUTPUTS' names


@dataclass(frozen=True)
class Answer:
    """One request's outcome as the front-end receives it: `rows` [n, width] float32, or `error`."""

    id: int
    rows: np.ndarray | None
    error: errors.ServiceError | None
    enqueued: float | None
    started: float | None
    done: float | None


def _int32(values: np.ndarray, what: str) -> np.ndarray:
    if len(values) and (values.min() < -2**31 or values.max() >= 2**31):
        raise ValueError(f"{what} outside int32")
    return values.astype("<i4", copy=False)


def pack_requests(requests: Sequence[tuple[int, int, Rows, bool, int | None, float, str]],
                  cancels: Sequence[int] = ()) -> list[bytes | memoryview]:
    """The request message of one tick: requests as (id, model, rows, normalize, dimensions, deadline, output)."""
    heads = np.empty(len(requests), REQUEST)
    for i, (rid, model, rows, normalize, dimensions, deadline, output) in enumerate(requests):
        flags = (HAS_PAIRS if rows.second is not None else 0) | OUTPUTS[output]
        heads[i] = (rid, model, flags, normalize, len(rows), dimensions or 0, deadline)
    every = [r[2] for r in requests]
    lengths = np.concatenate([r.lengths for r in every]) if every else np.empty(0, np.int64)
    ids = np.concatenate([r.ids for r in every]) if every else np.empty(0, np.int64)
    paired = [r.second for r in every if r.second is not None]
    seconds = np.concatenate(paired) if paired else np.empty(0, np.int64)
    return [heads.data, _int32(lengths, "a length").data, _int32(ids, "a token id").data,
            _int32(seconds, "a pair's start").data, np.asarray(cancels, dtype="<u8").data]


def unpack_requests(frames: Sequence[bytes | memoryview]) -> tuple[list[Submit], np.ndarray]:
    """A request message -> its requests (each its own Rows, int64 as the model takes them) and the cancelled ids.
    ValueError where the frames do not add up (a message from something that is not a front-end)."""
    if len(frames) != 5:
        raise ValueError(f"a request message has 5 frames, not {len(frames)}")
    heads = np.frombuffer(frames[0], REQUEST)
    lengths = np.frombuffer(frames[1], "<i4").astype(np.int64)
    ids = np.frombuffer(frames[2], "<i4").astype(np.int64)
    seconds = np.frombuffer(frames[3], "<i4").astype(np.int64)
    cancels = np.frombuffer(frames[4], "<u8")
    counts = heads["rows"].astype(np.int64)
    if int(counts.sum()) != len(lengths) or int(lengths.sum()) != len(ids) or (lengths < 1).any():
        raise ValueError("a request message's rows do not add up to its lengths and ids")
    paired = (heads["flags"] & HAS_PAIRS) != 0
    if int(counts[paired].sum()) != len(seconds):
        raise ValueError("a request message's pair starts do not add up")
    out, row, token, pair = [], 0, 0, 0
    for head, count, has_pairs in zip(heads.tolist(), counts.tolist(), paired.tolist()):
        rid, model, flags, normalize, _, dimensions, deadline = head
        lens = lengths[row:row + count]
        tokens = int(lens.sum())
        second = None
        if has_pairs:
            second, pair = seconds[pair:pair + count], pair + count
        out.append(Submit(rid, model, Rows(ids[token:token + tokens], lens, second), bool(normalize),
                          dimensions or None, deadline,
                          _OUTPUT_OF[flags & (TOKENS | SPARSE)]))
        row, token = row + count, token + tokens
    return out, cancels


def pack_replies(answers: Sequence[Answer]) -> list[bytes | memoryview]:
    """The reply message of one tick."""
    heads = np.empty(len(answers), REPLY)
    blocks, failed = [], []
    for i, a in enumerate(answers):
        stamps = tuple(NO_STAMP if s is None else s for s in (a.enqueued, a.started, a.done))
        if a.error is not None:
            heads[i] = (a.id, a.error.status, 0, 0, *stamps)
            failed.append({"id": a.id, **error_fields(a.error)})
        else:
            rows = np.ascontiguousarray(a.rows, dtype=np.float32)
            heads[i] = (a.id, 0, rows.shape[0], rows.shape[1], *stamps)
            blocks.append(rows.reshape(-1))
    block = np.concatenate(blocks) if len(blocks) > 1 else blocks[0] if blocks else np.empty(0, np.float32)
    return [heads.data, block.data, json.dumps(failed).encode() if failed else b""]


def unpack_replies(frames: Sequence[bytes | memoryview]) -> list[Answer]:
    if len(frames) != 3:
        raise ValueError(f"a reply message has 3 frames, not {len(frames)}")
    heads = np.frombuffer(frames[0], REPLY)
    block = np.frombuffer(frames[1], np.float32)
    failed = {e["id"]: e for e in json.loads(bytes(frames[2]))} if len(frames[2]) else {}
    out, at = [], 0
    for rid, status, rows, width, *stamps in heads.tolist():
        enqueued, started, done = (None if s == NO_STAMP else s for s in stamps)
        if status:
            out.append(Answer(rid, None, error_of({**failed[rid], "status": status}), enqueued, started, done))
            continue
        size = rows * width
        if at + size > len(block):
            raise ValueError("a reply message's block is shorter than its heads say")
        out.append(Answer(rid, block[at:at + size].reshape(rows, width), None, enqueued, started, done))
        at += size
    return out
