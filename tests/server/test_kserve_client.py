"""KServe v2 / Open Inference Protocol with the real `tritonclient[http]`: the binary tensor data extension (its
default, binary_data=True) and plain JSON, server metadata, model config and statistics, a compressed request, and
an error whose message the client prints."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.model.sentences import SENTENCES
from tests.tolerances import assert_same_rows

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


def test_compressed_request(client, expected):
    for algorithm in ("gzip", "deflate"):
        result = client.infer(MODEL, [_input(True)], request_compression_algorithm=algorithm)
        assert_same_rows(result.as_numpy("embedding"), expected, what=algorithm)


def test_server_metadata_config_and_stats(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_server_metadata()
    assert meta["name"] == "fusedserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata(MODEL)
    assert model["inputs"][0]["datatype"] == "BYTES" and model["outputs"][0]["shape"] == [-1, 384]
    config = client.get_model_config(MODEL)
    assert config["input"][0]["data_type"] == "TYPE_STRING" and config["output"][0]["dims"] == [-1, 384]
    before = client.get_inference_statistics(MODEL)["model_stats"][0]
    client.infer(MODEL, [_input(True)])
    after = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + len(TEXTS)
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1


def test_errors_print_their_message(client, server):
    with pytest.raises(InferenceServerException) as error:
        client.infer("no-such-model", [_input(True)])
    assert error.value.status() == "404" and "no-such-model" in str(error.value) and "is not served here" in \
        error.value.message()
    wrong = httpclient.InferInput("tokens", [1], "INT64")
    wrong.set_data_from_numpy(np.array([1], dtype=np.int64))
    with pytest.raises(InferenceServerException, match="expected exactly one BYTES input named 'text'"):
        client.infer(MODEL, [wrong])
    with pytest.raises(InferenceServerException, match="must be a boolean"):
        client.infer(MODEL, [_input(False)], parameters={"normalize": "yes"})
    assert httpx.get(server.url + "/v2/models/nope").json() == \
        {"error": f"model 'nope' is not served here; this server serves '{MODEL}'"}
