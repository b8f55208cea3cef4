"""What the KServe v2 HTTP routes (server.routes.kserve) and the gRPC service (server.kserve_grpc) share, so the two
protocols give one answer: the server's extensions, a model's metadata, configuration and statistics (as Triton's
JSON; the gRPC service fills its messages from the same dicts), the per-model counters behind the statistics, and
the reading of an infer request's input tensors into the rows a model embeds.

An embedding model takes one of two inputs: `text`, BYTES (texts, one per element, in row-major order), or
`input_ids`, INT64 or INT32 [n, L] ([L]: one row) of token ids with the model's special tokens, as /tokenize gives
them, with an optional `attention_mask` of the same shape whose ones come first in each row (right padding): a row
is its ids up to the mask's sum. Each transport hands the tensors over as InputTensor: the raw little-endian form
(HTTP's binary tensor data, gRPC's raw_input_contents), gRPC's typed contents, or HTTP's JSON data.

Nothing here imports grpc or protobuf: an HTTP-only install has neither."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusedserve.server.errors import BadRequest, PayloadTooLarge, clipped, quoted
from fusedserve.server.service import VERSION

TEXT, IDS, MASK, OUTPUT = "text", "input_ids", "attention_mask", "embedding"
# Triton's extension names for what both ports serve, and token_ids: an embedding model also takes `input_ids`
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "token_ids"]
# an embedding model's inputs: (name, datatype, shape; -1 is any size)
INPUTS = [(TEXT, "BYTES", [-1]), (IDS, "INT64", [-1, -1]), (MASK, "INT64", [-1, -1])]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# the raw form's element types of the integer inputs
_RAW = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4")}


# ---- metadata, configuration, statistics -----------------------------------------------------------------------
def server_metadata() -> dict:
    return {"name": "fusedserve", "version": VERSION, "extensions": EXTENSIONS}


def model_metadata(model) -> dict:
    """A model's metadata. A classifier is served on /rerank, /v1/rerank and /predict, not here: its metadata names
    no tensors (and `parameters`, which gRPC's message has no field for, says where it is served)."""
    if model.kind != "embedding":
        return {"name": model.name, "versions": ["1"], "platform": "pytorch", "inputs": [], "outputs": [],
                "parameters": {"kind": model.kind, "routes": "/rerank, /v1/rerank, /predict"}}
    return {
        "name": model.name, "versions": ["1"], "platform": "pytorch",
        "inputs": [{"name": name, "datatype": datatype, "shape": shape} for name, datatype, shape in INPUTS],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, model.dim]}],
    }


def model_config(model, settings) -> dict:
    """An embedding model's configuration in Triton's form (model_config.proto's JSON). Every input is optional:
    a request sends `text`, or `input_ids` with or without `attention_mask`."""
    return {
        "name": model.name, "platform": "pytorch", "backend": "fusedserve", "version_policy": {"latest": {
            "num_versions": 1}}, "max_batch_size": settings.max_client_batch,
        "input": [{"name": name, "data_type": "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}",
                   "dims": shape, "optional": True} for name, datatype, shape in INPUTS],
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [-1, model.dim]}],
        "dynamic_batching": {"max_queue_delay_microseconds": int(settings.max_wait_ms * 1000),
                             "preferred_batch_size": [settings.max_batch_requests]},
        "parameters": {"max_seq_length": {"string_value": str(model.description.max_length)},
                       "normalize": {"string_value": "true"}},
    }


@dataclass
class Stats:
    """A model's infer counters (Triton's statistics extension, the parts that apply), one set per model that HTTP's
    and gRPC's infer both count into."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    inferences: int = 0
    last_ms: int = 0

    @contextmanager
    def counted(self) -> Iterator[Inference]:
        """One infer call, HTTP's or gRPC's, timed from here: a success with the inputs the caller sets on what this
        yields once it has its embeddings, or a failure if an exception leaves the block. A cancelled call (its client
        went away) counts as neither."""
        started = time.perf_counter_ns()
        inference = Inference()
        try:
            yield inference
        except Exception:
            self.fail += 1
            self.fail_ns += time.perf_counter_ns() - started
            raise
        self.success += 1
        self.inferences += inference.inputs
        self.success_ns += time.perf_counter_ns() - started
        self.last_ms = int(time.time() * 1000)


@dataclass
class Inference:
    """What an infer call tells Stats.counted: the inputs it embedded."""

    inputs: int = 0


def stats_of(model) -> Stats:
    stats = getattr(model, "kserve_stats", None)
    if stats is None:
        stats = model.kserve_stats = Stats()
    return stats


def model_stats(service, name: str) -> dict:
    """Inference statistics in Triton's form: the named model's, or (no name) every served model's."""
    if name:
        models = [service.model(name)]
    else:
        service.check_ready()
        models = service.serving
    zero = {"count": 0, "ns": 0}
    out = []
    for model in models:
        st = stats_of(model)
        out.append({
            "name": model.name, "version": "1", "last_inference": st.last_ms, "inference_count": st.inferences,
            "execution_count": st.success, "inference_stats": {
                "success": {"count": st.success, "ns": st.success_ns}, "fail": {"count": st.fail, "ns": st.fail_ns},
                "queue": zero, "compute_input": zero, "compute_infer": zero, "compute_output": zero},
            "batch_stats": []})
    return {"model_stats": out}


# ---- a tensor's shape and elements, read with bounded work ------------------------------------------------------
def shape_text(shape: Sequence[int]) -> str:
    """A client's shape as an error message repeats it, cut at 100 characters. Only the dims that reach the cut are
    written out (a shape may have millions), and none past int64 (converting a long integer to text costs time that
    grows with its square)."""
    parts: list[str] = []
    length = 0
    for d in shape:
        if length > 100:  # past the cut: the rest is not written out
            return f"[{', '.join(parts)}"[:100] + f"... ({len(shape)} dims)"
        parts.append(str(d) if INT64_MIN <= d <= INT64_MAX else "(past int64)")
        length += len(parts[-1]) + 2
    return clipped("[" + ", ".join(parts) + "]")


def element_count(name: str, shape: Sequence[int]) -> int:
    """The number of elements a tensor of this shape holds, counted in int64 as Triton counts it: a 400 for a
    negative dim or a count past int64. The product is taken a few dims at a time and stops once past int64, so no
    product grows past a few thousand bits; a zero dim means no elements, whatever the others."""
    if not shape:
        return 1
    if min(shape) < 0:
        raise BadRequest(f"input {quoted(name)} has a negative dim in shape {shape_text(shape)}")
    if max(shape) > INT64_MAX:
        raise BadRequest(f"input {quoted(name)} has a dim past int64 in shape {shape_text(shape)}")
    if 0 in shape:
        return 0
    count = 1
    for start in range(0, len(shape), 64):
        count *= math.prod(shape[start: start + 64])
        if count > INT64_MAX:
            raise BadRequest(f"input {quoted(name)} of shape {shape_text(shape)} holds more elements than int64 counts")
    return count


def deserialize_bytes(buffer: bytes, max_items: int) -> list[bytes]:
    """BYTES tensor data in the raw form: each element a 4-byte little-endian length and that many bytes. A 413 once
    the buffer holds more than `max_items` elements (max_client_batch), read no further: four bytes make an empty
    element, so a few megabytes can hold a million."""
    out: list[bytes] = []
    offset = 0
    while offset < len(buffer):
        if len(out) == max_items:
            raise PayloadTooLarge(f"binary BYTES data holds more than {max_items} elements; the limit is {max_items} "
                                  f"(max_client_batch)")
        if offset + 4 > len(buffer):
            raise BadRequest("binary BYTES data ends inside an element's length")
        (length,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if offset + length > len(buffer):
            raise BadRequest("binary BYTES data ends inside an element")
        out.append(buffer[offset: offset + length])
        offset += length
    return out


def flatten(data: list[Any], limit: int) -> list[Any]:
    """The elements of nested lists in order, stopping once there are more than `limit` (the shape's count: the
    rest cannot match it). Iterative: the nesting may be as deep as the JSON parser allows."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > limit:
                return out
        else:
            stack.pop()
    return out


# ---- an infer request's inputs -> the rows a model embeds ------------------------------------------------------
@dataclass(frozen=True)
class InputTensor:
    """One input as a transport carries it, its elements in one of three forms: `raw` (little-endian, BYTES elements
    each a 4-byte length and the bytes), `values` (flat, already of the datatype's type: gRPC's typed contents) or
    `data` (JSON, nested lists allowed, each element checked here). None of them: the tensor came without data."""

    name: str
    datatype: str
    shape: Sequence[int]
    raw: bytes | None = None
    values: Sequence[Any] | None = None
    data: list[Any] | None = None


def read_rows(inputs: Sequence[InputTensor], max_items: int) -> list[str] | list[list[int]]:
    """The texts, or the token-id rows, an infer request's inputs hold; a 413 past `max_items` inputs
    (max_client_batch), checked from the shape before any element is read."""
    named: dict[str, InputTensor] = {}
    for tensor in inputs:
        if tensor.name in named:
            raise BadRequest(f"input {quoted(tensor.name)} given twice")
        named[tensor.name] = tensor
    if TEXT in named:
        if len(named) > 1:
            raise BadRequest(f"input {TEXT!r} comes alone (texts, or {IDS!r} with {MASK!r})")
        return _texts(named[TEXT], max_items)
    if IDS in named:
        if set(named) - {IDS, MASK}:
            others = ", ".join(quoted(n, 40) for n in list(set(named) - {IDS, MASK})[:3])
            raise BadRequest(f"inputs are {TEXT!r}, or {IDS!r} with an optional {MASK!r}; not {others}")
        return _id_rows(named[IDS], named.get(MASK), max_items)
    given = ", ".join(quoted(n, 40) for n in list(named)[:3]) or "none"
    raise BadRequest(f"expected an input named {TEXT!r} (BYTES) or {IDS!r} (INT64); given: {given}")


def _check_inputs(count: int, shape: Sequence[int], max_items: int) -> None:
    if count > max_items:
        raise PayloadTooLarge(f"shape {shape_text(shape)} holds {count} inputs; the limit is {max_items} "
                              f"(max_client_batch)")


def _elements(tensor: InputTensor, count: int) -> Sequence[Any]:
    """The tensor's elements from its typed or JSON form, checked against the shape's count."""
    if tensor.values is not None:
        values = tensor.values
    elif tensor.data is not None:
        values = flatten(tensor.data, count)
    else:
        raise BadRequest(f"input {quoted(tensor.name)} has neither data nor binary_data_size")
    if len(values) != count:
        found = f"more than {count}" if len(values) > count else str(len(values))
        raise BadRequest(f"shape {shape_text(tensor.shape)} of input {quoted(tensor.name)} does not match {found} "
                         f"data elements")
    return values


def _texts(tensor: InputTensor, max_items: int) -> list[str]:
    if tensor.datatype != "BYTES":
        raise BadRequest(f"input {TEXT!r} is BYTES, not {clipped(tensor.datatype)}")
    count = element_count(TEXT, tensor.shape)
    _check_inputs(count, tensor.shape, max_items)
    if tensor.raw is not None:
        items: Sequence[Any] = deserialize_bytes(tensor.raw, max_items)
        if len(items) != count:
            raise BadRequest(f"shape {shape_text(tensor.shape)} of input {TEXT!r} does not match {len(items)} BYTES "
                             f"elements")
    else:
        items = _elements(tensor, count)
    try:
        texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in items]
    except UnicodeDecodeError:
        raise BadRequest("BYTES input data must be UTF-8 text") from None
    if not all(isinstance(t, str) for t in texts):  # JSON: a number or an object where a text belongs
        raise BadRequest("BYTES input data must be strings")
    return texts


def _integers(tensor: InputTensor, max_items: int) -> np.ndarray:
    """An INT64 / INT32 input as an int64 array [rows, L] ([L] is one row)."""
    name, shape = tensor.name, tensor.shape
    if tensor.datatype not in _RAW or len(shape) not in (1, 2):
        raise BadRequest(f"input {quoted(name)} is INT64 or INT32 of shape [n, L], not {clipped(tensor.datatype)} "
                         f"{shape_text(shape)}")
    count = element_count(name, shape)
    if count == 0:
        raise BadRequest(f"input {quoted(name)} of shape {shape_text(shape)} holds no token ids")
    _check_inputs(1 if len(shape) == 1 else shape[0], shape, max_items)
    if tensor.raw is not None:
        dtype = _RAW[tensor.datatype]
        if len(tensor.raw) != count * dtype.itemsize:
            raise BadRequest(f"input {quoted(name)}: {len(tensor.raw)} raw bytes for shape {shape_text(shape)} of "
                             f"{tensor.datatype}")
        values = np.frombuffer(tensor.raw, dtype=dtype).astype(np.int64)
    else:
        elements = _elements(tensor, count)
        # JSON's numbers: integers only (a bool is an int to Python, not to JSON); the parser kept them within int64
        if tensor.values is None and not all(type(v) is int for v in elements):
            raise BadRequest(f"input {quoted(name)} is {tensor.datatype}: its data must be integers")
        values = np.asarray(elements, dtype=np.int64)
        if tensor.datatype == "INT32" and (values.min() < _INT32_MIN or values.max() > _INT32_MAX):
            raise BadRequest(f"input {quoted(name)} is INT32: a value is past int32")
    return values.reshape(-1, shape[-1])


def _id_rows(ids: InputTensor, mask: InputTensor | None, max_items: int) -> list[list[int]]:
    block = _integers(ids, max_items)
    if mask is None:
        return block.tolist()
    m = _integers(mask, max_items)
    if m.shape != block.shape:
        raise BadRequest(f"{MASK!r} has shape {list(m.shape)}, {IDS!r} {list(block.shape)}")
    if not np.isin(m, (0, 1)).all():
        raise BadRequest(f"{MASK!r} holds values other than 0 and 1")
    lengths = m.sum(axis=1)
    # right padding only: each row's ones first, then zeros (a left-padded row's ids would be read from the pad)
    if (m != (np.arange(m.shape[1]) < lengths[:, None])).any():
        raise BadRequest(f"{MASK!r} must be ones then zeros in each row (right padding)")
    return [row[:n] for row, n in zip(block.tolist(), lengths.tolist())]
