"""KServe v2 / Open Inference Protocol with the real `tritonclient[http]`: the binary tensor data extension (its
default, binary_data=True) and plain JSON, texts and token ids (INT64 or INT32, padded, with an attention mask)
answered with the same rows, server metadata, model config and statistics, a compressed request, and errors whose
message the client prints (4xx, never 5xx)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.model.sentences import SENTENCES
from tests.server.conftest import padded_ids
from tests.tolerances import assert_embeddings_close, assert_same_rows

MODEL = "all-MiniLM-L6-v2"
TEXTS = [SENTENCES[0], "東京は日本の首都です。", "", "x" * 3]


@pytest.fixture(scope="module")
def client(server):
    return httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def expected(server) -> np.ndarray:
    r = httpx.post(server.url + "/infer", json={"inputs": TEXTS}, timeout=60)
    return np.array(r.json()["embeddings"], dtype=np.float32)


def _input(binary: bool):
    tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), binary_data=binary)
    return tensor


def _tensor(name: str, array: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "INT32")
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _fails(call, status: int, *words: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() == str(status), (caught.value.status(), caught.value.message())
    for word in words:
        assert word in caught.value.message(), caught.value.message()


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])  # None: no outputs named (binary_data_output)
def test_infer(client, expected, binary_in, binary_out):
    outputs = None if binary_out is None else [httpclient.InferRequestedOutput("embedding", binary_data=binary_out)]
    result = client.infer(MODEL, [_input(binary_in)], outputs=outputs, request_id="r-1")
    got = result.as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 384)
    assert_same_rows(got, expected)  # /infer's request: the same rows, float32 exactly in JSON and binary alike
    response = result.get_response()
    assert response["id"] == "r-1" and response["model_name"] == MODEL
    assert ("binary_data_size" in (response["outputs"][0].get("parameters") or {})) == (binary_out is not False)


@pytest.mark.parametrize("binary", [True, False])  # raw little-endian after the JSON, or JSON numbers
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_token_ids_with_a_mask_give_the_texts_rows(server, client, expected, binary, dtype):
    ids, mask = padded_ids(server.url, TEXTS, dtype)
    inputs = [_tensor("input_ids", ids, binary), _tensor("attention_mask", mask, binary)]
    got = client.infer(MODEL, inputs).as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 384)
    assert_same_rows(got, expected)
    row = ids[0, :mask[0].sum()]  # [L]: one row, unpadded; alone, so another batch's shapes (close, not the same bits)
    one = client.infer(MODEL, [_tensor("input_ids", row, binary)]).as_numpy("embedding")
    assert_embeddings_close(one, expected[:1])


def test_bad_token_ids_are_a_clear_4xx(server, client):
    ids, mask = padded_ids(server.url, TEXTS[:2])
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.full((1, 4), 10**7))]), 422, "outside the vocabulary")
    left_padded = mask[:, ::-1].copy()
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", left_padded)]), 400,
           "right padding")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", mask[:1])]), 400,
           "shape")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("attention_mask", ids)]), 400, "0 and 1")
    _fails(lambda: client.infer(MODEL, [_input(True), _tensor("input_ids", ids)]), 400, "alone")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", ids), _tensor("input_ids", ids)]), 400, "twice")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.zeros((300, 4), np.int64))]), 413, "256")
    _fails(lambda: client.infer(MODEL, [_tensor("input_ids", np.zeros((2, 2, 2), np.int64))]), 400, "[n, L]")
    wrong_type = httpclient.InferInput("input_ids", [1, 2], "FP32")
    wrong_type.set_data_from_numpy(np.ones((1, 2), np.float32))
    _fails(lambda: client.infer(MODEL, [wrong_type]), 400, "INT64 or INT32")
    url = server.url + f"/v2/models/{MODEL}/infer"
    for data, word in (([1.5, 2], "integers"), ([True, 2], "integers"), (["a", 2], "integers"),
                       ([1], "does not match")):
        body = {"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": data}]}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"], r.text
    body = {"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT32", "data": [2**40]}]}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400 and "int32" in r.json()["error"], r.text
    assert client.infer(MODEL, [_tensor("input_ids", ids)]).as_numpy("embedding").shape == (2, 384)  # still serving


def test_compressed_request(client, expected):
    for algorithm in ("gzip", "deflate"):
        result = client.infer(MODEL, [_input(True)], request_compression_algorithm=algorithm)
        assert_same_rows(result.as_numpy("embedding"), expected, what=algorithm)


def test_server_metadata_config_and_stats(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_server_metadata()
    assert meta["name"] == "fusedserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(MODEL)
    assert {t["name"]: (t["datatype"], t["shape"]) for t in model["inputs"]} == {
        "text": ("BYTES", [-1]), "input_ids": ("INT64", [-1, -1]), "attention_mask": ("INT64", [-1, -1])}
    assert model["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    config = client.get_model_config(MODEL)
    assert [(t["name"], t["data_type"], t["optional"]) for t in config["input"]] == [
        ("text", "TYPE_STRING", True), ("input_ids", "TYPE_INT64", True), ("attention_mask", "TYPE_INT64", True)]
    assert config["output"][0]["dims"] == [-1, 384]
    before = client.get_inference_statistics(MODEL)["model_stats"][0]
    client.infer(MODEL, [_input(True)])
    _fails(lambda: client.infer(MODEL, [_input(False)], parameters={"normalize": "yes"}), 400)
    after = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + len(TEXTS)
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    assert after["last_inference"] >= before["last_inference"] > 0
    # no name: every served model's (Triton's GET /v2/models/stats), this server's one
    assert [m["name"] for m in client.get_inference_statistics()["model_stats"]] == [MODEL]
    _fails(lambda: client.get_model_config("nope"), 404, "'nope'")
    _fails(lambda: client.get_inference_statistics("nope"), 404, "'nope'")


def test_errors_print_their_message(client, server):
    with pytest.raises(InferenceServerException) as error:
        client.infer("no-such-model", [_input(True)])
    assert error.value.status() == "404" and "no-such-model" in str(error.value) and "is not served here" in \
        error.value.message()
    wrong = httpclient.InferInput("tokens", [1], "INT64")
    wrong.set_data_from_numpy(np.array([1], dtype=np.int64))
    with pytest.raises(InferenceServerException, match="expected an input named 'text' \\(BYTES\\) or 'input_ids'"):
        client.infer(MODEL, [wrong])
    with pytest.raises(InferenceServerException, match="must be a boolean"):
        client.infer(MODEL, [_input(False)], parameters={"normalize": "yes"})
    assert httpx.get(server.url + "/v2/models/nope").json() == \
        {"error": f"model 'nope' is not served here; this server serves '{MODEL}'"}
