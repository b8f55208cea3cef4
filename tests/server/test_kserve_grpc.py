"""KServe v2 over gRPC with the real `tritonclient.grpc`: health and metadata, texts and token ids (padded, with an
attention mask) answered with the rows HTTP gives, bad input as a gRPC status with a clear message, the API keys, the
metrics; the same answers as the HTTP port's through `tritonclient.http` (server and model metadata, the model
config, the statistics, which both ports' infer calls count into); and the committed descriptor is what
predict_v2.proto compiles to."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from fusedserve.server.kserve_grpc import SERVICE, _message
from tests.model.sentences import SENTENCES
from tests.server.conftest import free_port, padded_ids, start_server
from tests.server.test_behaviour import BATCHES_STARTED, _value, stall
from tests.support import grpc_descriptor
from tests.tolerances import assert_same_rows, assert_unit_length, tolerance

MODEL = "all-MiniLM-L6-v2"
TEXTS = [SENTENCES[0], "東京は日本の首都です。", "", "a much longer input, " * 12]


@pytest.fixture(scope="module")
def rpc(tmp_path_factory):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("grpc"), grpc_port=port, max_body_bytes=64 * 1024)
    srv.grpc = f"127.0.0.1:{port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(rpc):
    c = grpcclient.InferenceServerClient(rpc.grpc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(rpc):
    """tritonclient.http on the same server's HTTP port."""
    c = httpclient.InferenceServerClient(url=rpc.url.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def expected(rpc) -> np.ndarray:
    r = httpx.post(rpc.url + "/infer", json={"inputs": TEXTS}, timeout=60)
    return np.array(r.json()["embeddings"], dtype=np.float32)


def _texts(texts: list[str]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def _tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "INT32")
    tensor.set_data_from_numpy(array)
    return tensor


def _fails(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() == str(code), (caught.value.status(), caught.value.message())
    for word in words:
        assert word in caught.value.message(), caught.value.message()


def test_the_descriptor_is_the_proto_compiled():
    assert grpc_descriptor.MODULE.read_text() == grpc_descriptor.render(), \
        "server/kserve_grpc/descriptor.py is stale: run `python -m tests.support.grpc_descriptor`"


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "fusedserve" and meta["version"]
    model = client.get_model_metadata(MODEL, as_json=True)
    assert model["name"] == MODEL and model["versions"] == ["1"]
    assert {t["name"]: t["datatype"] for t in model["inputs"]} == {"text": "BYTES", "input_ids": "INT64",
                                                                   "attention_mask": "INT64"}
    assert model["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": ["-1", "384"]}]
    _fails(lambda: client.get_model_metadata("nope"), grpc.StatusCode.NOT_FOUND, "'nope'", MODEL)
    _fails(lambda: client.is_model_ready(MODEL, "2"), grpc.StatusCode.NOT_FOUND, "version '2'")


def test_metadata_and_extensions_are_the_same_over_both_protocols(client, http):
    """Each gRPC answer is the HTTP JSON read into Triton's message (tritonclient's own generated classes)."""
    server = client.get_server_metadata()
    assert server == json_format.ParseDict(http.get_server_metadata(), service_pb2.ServerMetadataResponse())
    assert list(server.extensions) == ["binary_tensor_data", "model_configuration", "statistics", "token_ids"]
    model = client.get_model_metadata(MODEL)
    assert model == json_format.ParseDict(http.get_model_metadata(MODEL), service_pb2.ModelMetadataResponse())
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("text", "BYTES", [-1]), ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]


def test_model_config_is_the_http_one(client, http):
    got = client.get_model_config(MODEL)
    assert got.config == json_format.ParseDict(http.get_model_config(MODEL), model_config_pb2.ModelConfig())
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL and config["max_batch_size"] == 256 and config["backend"] == "fusedserve"
    assert [(t["name"], t["data_type"]) for t in config["input"]] == [
        ("text", "TYPE_STRING"), ("input_ids", "TYPE_INT64"), ("attention_mask", "TYPE_INT64")]
    assert config["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": ["-1", "384"]}]
    _fails(lambda: client.get_model_config("nope"), grpc.StatusCode.NOT_FOUND, "'nope'", MODEL)
    _fails(lambda: client.get_model_config(MODEL, "2"), grpc.StatusCode.NOT_FOUND, "version '2'")


def test_statistics_are_one_set_of_counters_for_both_protocols(client, http):
    def both() -> dict:
        """The model's statistics over gRPC, checked equal to HTTP's (no call in between here)."""
        got = client.get_inference_statistics(MODEL)
        assert got == json_format.ParseDict(http.get_inference_statistics(MODEL),
                                            service_pb2.ModelStatisticsResponse())
        assert len(got.model_stats) == 1
        return json_format.MessageToDict(got.model_stats[0], preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)

    before = both()
    client.infer(MODEL, [_texts(TEXTS[:2])])
    text = httpclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"over HTTP"], dtype=np.object_))
    http.infer(MODEL, [text])
    _fails(lambda: client.infer(MODEL, [_texts(["x"])], parameters={"normalize": "yes"}),
           grpc.StatusCode.INVALID_ARGUMENT, "boolean")
    after = both()
    success, fail = after["inference_stats"]["success"], after["inference_stats"]["fail"]
    assert int(success["count"]) == int(before["inference_stats"]["success"]["count"]) + 2
    assert int(fail["count"]) == int(before["inference_stats"]["fail"]["count"]) + 1
    assert int(after["inference_count"]) == int(before["inference_count"]) + 3
    assert int(success["ns"]) > int(before["inference_stats"]["success"]["ns"])
    # no name: every served model's, as Triton answers
    assert [m.name for m in client.get_inference_statistics().model_stats] == [MODEL]
    _fails(lambda: client.get_inference_statistics("nope"), grpc.StatusCode.NOT_FOUND, "'nope'")
    _fails(lambda: client.get_inference_statistics(MODEL, "2"), grpc.StatusCode.NOT_FOUND, "version '2'")


def test_texts_give_the_rows_http_gives(client, expected):
    result = client.infer(MODEL, [_texts(TEXTS)], request_id="g-1")
    got = result.as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 384)
    assert_same_rows(got, expected)
    assert result.get_response().id == "g-1" and result.get_response().model_name == MODEL
    assert_unit_length(got[[0, 1, 3]])  # normalized by default, as the HTTP KServe route (the empty text apart)
    params = {"normalize": False}
    raw = client.infer(MODEL, [_texts(TEXTS[:1])], parameters=params).as_numpy("embedding")
    # not normalized: its length is off 1 by more than the table lets a normalized row be
    assert abs(np.linalg.norm(raw[0]) - 1) > tolerance().max_abs


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_token_ids_with_a_mask_give_the_texts_rows(rpc, client, expected, dtype):
    ids, mask = padded_ids(rpc.url, TEXTS, dtype)
    got = client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", mask)]).as_numpy("embedding")
    assert_same_rows(got, expected)
    one = client.infer(MODEL, [_tensor("input_ids", ids[3])]).as_numpy("embedding")  # [L]: one unpadded row
    assert_same_rows(one, expected[3:])


def test_typed_contents_are_read_as_raw_ones_are(rpc):
    """The protocol's other form, each element in the typed field (KServe's own clients send it): the rows HTTP gives
    for the same two texts (the same batch, so the same values to the bit; another batch's GEMM shapes may round
    differently on the CPU)."""
    expected = np.array(httpx.post(rpc.url + "/infer", json={"inputs": TEXTS[:2]}, timeout=60).json()["embeddings"],
                        dtype=np.float32)
    ids, mask = padded_ids(rpc.url, TEXTS[:2])
    Request, Response = _message("ModelInferRequest"), _message("ModelInferResponse")
    request = Request(model_name=MODEL)
    text = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend(t.encode() for t in TEXTS[:2])
    by_ids = Request(model_name=MODEL)
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        tensor = by_ids.inputs.add(name=name, datatype="INT64", shape=list(array.shape))
        tensor.contents.int64_contents.extend(array.ravel().tolist())
    with grpc.insecure_channel(rpc.grpc) as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=Request.SerializeToString,
                                    response_deserializer=Response.FromString)
        for message in (request, by_ids):
            response = infer(message, timeout=60)
            got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(list(response.outputs[0].shape))
            assert_same_rows(got, expected)


def test_bad_input_is_a_clear_grpc_status_and_the_server_keeps_serving(rpc, client):
    bad = grpc.StatusCode.INVALID_ARGUMENT
    ids, mask = padded_ids(rpc.url, TEXTS[:2])
    wrong = grpcclient.InferInput("texts", [1], "BYTES")
    wrong.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
    _fails(lambda: client.infer(MODEL, [wrong]), bad, "'text'", "'input_ids'")
    not_utf8 = grpcclient.InferInput("text", [1], "BYTES")
    not_utf8.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=np.object_))
    _fails(lambda: client.infer(MODEL, [not_utf8]), bad, "UTF-8")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.full((1, 4), 10**7))]), bad, "outside the vocabulary")
    left_padded = mask[:, ::-1].copy()
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", left_padded)]), bad,
           "right padding")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", mask[:1])]), bad,
           "shape")
    _fails(lambda: client.infer(MODEL, [_texts(["x"]), _tensor("input_ids", ids)]), bad, "alone")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("input_ids", ids)]), bad, "twice")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.zeros((2, 2, 2), np.int64))]), bad, "[n, L]")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.zeros((300, 2), np.int64))]), bad, "256")
    _fails(lambda: client.infer(MODEL, [_texts(["x"])], outputs=[grpcclient.InferRequestedOutput("logits")]), bad,
           "'embedding'")
    _fails(lambda: client.infer(MODEL, [_texts(["x"])], parameters={"normalize": "yes"}), bad, "boolean")
    _fails(lambda: client.infer("nope", [_texts(["x"])]), grpc.StatusCode.NOT_FOUND, "'nope'")
    _fails(lambda: client.infer(MODEL, [_texts(["x"] * 300)]), bad, "256")  # max_client_batch
    # over max_body_bytes (64 KiB here): refused by gRPC itself, naming the sizes
    _fails(lambda: client.infer(MODEL, [_texts(["word " * 20_000])]), grpc.StatusCode.RESOURCE_EXHAUSTED, "65536")
    assert client.infer(MODEL, [_texts(["still serving"])]).as_numpy("embedding").shape == (1, 384)


def test_metrics_count_grpc_calls(rpc, client):
    route = f"/{SERVICE}/ModelInfer"
    before = _value(httpx.get(rpc.url + "/metrics").text, "fusedserve_requests_total", route=route, status="200")
    client.infer(MODEL, [_texts(["counted"])])
    _fails(lambda: client.infer(MODEL, [_texts(["x"] * 300)]), grpc.StatusCode.INVALID_ARGUMENT)
    text = httpx.get(rpc.url + "/metrics").text
    assert _value(text, "fusedserve_requests_total", route=route, status="200") == before + 1
    assert _value(text, "fusedserve_requests_total", route=route, status="413") >= 1


def test_api_keys_guard_grpc_as_they_guard_http(tmp_path):
    port = free_port()
    srv = start_server(tmp_path, grpc_port=port, api_keys="k1,k2")
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live() and client.is_server_ready()  # the probes stay open, as on HTTP
        _fails(lambda: client.infer(MODEL, [_texts(["x"])]), grpc.StatusCode.UNAUTHENTICATED, "missing API key")
        _fails(lambda: client.infer(MODEL, [_texts(["x"])], headers={"authorization": "Bearer k3"}),
               grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        got = client.infer(MODEL, [_texts(["x"])], headers={"authorization": "Bearer k2"})
        assert got.as_numpy("embedding").shape == (1, 384)
        client.close()
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once its shutdown is complete


def test_a_call_in_flight_is_answered_through_sigterm_and_new_ones_refused(tmp_path):
    port = free_port()
    srv = start_server(tmp_path, faults=True, grpc_port=port)
    stall(srv, 1.0)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(client.infer, MODEL, [_texts(["accepted before SIGTERM"])])
        deadline = time.monotonic() + 30
        while _value(httpx.get(srv.url + "/metrics").text, BATCHES_STARTED) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while client.is_server_ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        _fails(lambda: client.infer(MODEL, [_texts(["arrives while draining"])]), grpc.StatusCode.UNAVAILABLE,
               "shutting down")
        assert in_flight.result(timeout=60).as_numpy("embedding").shape == (1, 384)
    client.close()
    assert srv.process.wait(timeout=30) in (0, -signal.SIGTERM)
