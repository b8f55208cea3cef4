"""Hand-written hostile inputs: each gets a JSON 4xx (or a correct 200 where the input is merely odd),
never a 5xx or a hang, and the server keeps serving."""

from __future__ import annotations

import gzip
import zlib

import httpx
import orjson
import pytest

JSON = {"content-type": "application/json"}
NAME = "all-MiniLM-L6-v2"

CASES = [
    ("deeply nested array", "/infer", b"[" * 100_000, 400),
    ("deeply nested inside a field", "/infer", b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("invalid UTF-8", "/infer", b'{"inputs": ["\xff\xfe"]}', 400),
    ("10^5 inputs", "/infer", {"inputs": ["a"] * 100_000}, 413),
    ("10^6-character string", "/infer", {"inputs": ["ab " * 333_333]}, 413),  # over max_request_chars
    ("5 x 10^5-character string", "/infer", {"inputs": ["ab " * 170_000]}, 200),  # under it
    ("JSON booleans as token ids", "/v1/embeddings", {"input": [True, False]}, 422),
    ("TEI JSON booleans as token ids", "/embed", {"inputs": [[101, True, 102]]}, 422),
    ("TEI decode booleans", "/decode", {"ids": [True, False]}, 422),
    ("dimensions as a string", "/v1/embeddings", {"input": "x", "dimensions": "5"}, 422),
    ("dimensions as a float", "/v1/embeddings", {"input": "x", "dimensions": 2.0}, 422),
    ("TEI dimensions as a string", "/embed", {"inputs": "x", "dimensions": "5"}, 422),
    ("TEI decode over max_batch_tokens ids", "/decode", {"ids": [1000] * 3000}, 413),  # the tests' limit: 2048
    ("TEI tokenize over max_batch_tokens tokens", "/tokenize", {"inputs": "a " * 3000}, 413),
    ("KServe truncated gzip", f"/v2/models/{NAME}/infer", "gzip-cut", 400),
    ("NUL bytes", "/infer", {"inputs": ["a\u0000b\u0000"]}, 200),
    ("lone surrogate escape", "/infer", b'{"inputs": ["ok", "\\ud800"]}', 400),  # orjson: not valid JSON text
    ("null inputs", "/infer", {"inputs": None}, 422),
    ("nested list of texts", "/infer", {"inputs": [["a"]]}, 422),
    ("normalize as string", "/infer", {"inputs": "a", "normalize": "yes please"}, 422),
    ("normalize as a truthy string", "/infer", {"inputs": "a", "normalize": "yes"}, 422),  # booleans only
    ("truncate as a number", "/v1/embeddings", {"input": "a", "truncate": 1}, 422),
    ("TEI normalize as a string", "/embed", {"inputs": "a", "normalize": "true"}, 422),
    ("TEI token id out of vocabulary", "/embed", {"inputs": [101, 10**9, 102]}, 422),
    ("TEI decode id out of vocabulary", "/decode", {"ids": [101, -1]}, 422),
    ("TEI no inputs", "/embed", {"inputs": []}, 400),
    ("TEI huge dimensions", "/embed", {"inputs": "a", "dimensions": 100000}, 400),
    ("TEI unknown truncation direction", "/embed", {"inputs": "a", "truncation_direction": "up"}, 422),
    ("KServe binary size past the body", f"/v2/models/{NAME}/infer",
     b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 99}}]}',
     400),
    ("KServe normalize as a string", f"/v2/models/{NAME}/infer",
     {"parameters": {"normalize": "yes"}, "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                                      "data": ["a"]}]}, 400),
    ("huge dimensions", "/v1/embeddings", {"input": "x", "dimensions": 10**30}, 422),  # orjson reads 1e30: not an int
    ("negative dimensions", "/v1/embeddings", {"input": "x", "dimensions": -5}, 400),
    ("token id out of vocabulary", "/v1/embeddings", {"input": [[101, 10**12, 102]]}, 422),
    ("negative token id", "/v1/embeddings", {"input": [101, -1, 102]}, 422),
    ("empty token list", "/v1/embeddings", {"input": [[]]}, 422),
    ("mixed ids and text", "/v1/embeddings", {"input": [1, "a"]}, 422),
    ("unknown model", "/v1/embeddings", {"input": "x", "model": "../../etc/passwd"}, 404),
    ("unknown encoding", "/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 422),
    ("KServe nested JSON", f"/v2/models/{NAME}/infer", b"[" * 10_000, 422),
    ("KServe wrong datatype", f"/v2/models/{NAME}/infer",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400),
    ("KServe non-string data", f"/v2/models/{NAME}/infer",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [7]}]}, 400),
    ("KServe unknown model", "/v2/models/nope/infer", {"inputs": []}, 404),
]


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(server, name, path, body, status):
    if body == "gzip-cut":  # a valid request, gzip-compressed, its stream cut short
        whole = gzip.compress(orjson.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                                        "data": ["a"]}]}))
        body = whole[: len(whole) - 6]
        assert zlib.decompressobj(wbits=31).decompress(body)  # the cut stream still inflates, in part
        kwargs = {"content": body, "headers": {**JSON, "content-encoding": "gzip"}}
    else:
        kwargs = {"content": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=60, **kwargs)
    assert r.status_code == status, r.text[:300]
    if status >= 400:
        error = r.json()["error"]
        if path.startswith("/v2/"):  # the Open Inference Protocol's error body: {"error": "<message>"}
            assert isinstance(error, str) and error
        elif path in ("/embed", "/decode", "/tokenize"):  # text-embeddings-inference's: {"error", "error_type"}
            assert isinstance(error, str) and error and r.json()["error_type"]
        else:
            assert error["type"] and error["message"]
        assert "Traceback" not in r.text and 'File "' not in r.text
    assert httpx.post(server.url + "/infer", json={"inputs": ["still serving"]}, timeout=30).status_code == 200


def test_over_long_input_is_truncated_by_default(server):
    r = httpx.post(server.url + "/infer", json={"inputs": ["word " * 5000]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["tokens"] == 256
