"""`python -m bench serve m3`: the shapes' order, the answers' token count read off the body's tail, the comparison
of one forward's outputs, the medians and ratios on made-up rows; then the scenario end to end on the CPU (the tiny
BGE-M3 shape, built into a cache of the test's own, one 1x2 point, a second of each shape). It asserts structure and
counts, never a rate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from bench import m3_load, serve
from bench import results as store
from bench.__main__ import main
from bench.harness import mixed_texts


def test_the_shapes_take_turns():
    assert m3_load.shape_order(0) == ["dense", "all-in-one", "three-requests", "sparse"]
    assert m3_load.shape_order(1) == ["sparse", "three-requests", "all-in-one", "dense"]
    assert [len(outputs) for outputs in m3_load.SHAPES.values()] == [1, 1, 3, 1]


def test_the_prompt_tokens_come_off_the_tail():
    body = {"object": "list", "data": [{"object": "embedding", "index": i, "multi_vector": [[0.5, -1.0]] * 3}
                                       for i in range(2)], "model": "m", "usage": {"prompt_tokens": 9, "total_tokens": 9}}
    compact = json.dumps(body, separators=(",", ":")).encode()  # as orjson writes it
    assert m3_load._prompt_tokens(200, compact, 2) == 9
    assert m3_load._prompt_tokens(200, compact, 3) is None  # an item short
    assert m3_load._prompt_tokens(503, compact, 2) is None
    assert m3_load._prompt_tokens(200, b'{"detail":"overloaded"}', 2) is None


def test_one_forwards_outputs_compare():
    a = [np.array([[1.0, 2.0]]), np.array([[0.0, 0.0], [3.0, 4.0]])]
    same = m3_load.compare(a, [x.copy() for x in a])
    assert same["float_equal"] and same["same"] and same["min_cosine"] == pytest.approx(1.0)
    close = m3_load.compare(a, [a[0] * (1 + 1e-7), a[1]])  # a scale: cosine 1, not float-equal
    assert not close["float_equal"] and close["same"] and close["max_abs_diff"] > 0
    other = m3_load.compare(a, [np.array([[2.0, -1.0]]), a[1]])
    assert not other["same"] and other["min_cosine"] == pytest.approx(0.0)
    fewer = m3_load.compare(a, [a[0], a[1][:1]])  # a multi-vector short of a token
    assert not fewer["same"] and fewer["shapes"] == [[[2, 2], [1, 2]]]
    x, y = m3_load._sparse_pair([{"index": 7, "value": 0.5}], [{"index": 7, "value": 0.5}, {"index": 9, "value": 0.1}])
    assert x.tolist() == [[0.5, 0.0]] and y.tolist() == [[0.5, 0.1]]
    empty = m3_load._sparse_pair([], [])
    assert m3_load.compare([empty[0]], [empty[1]])["same"]  # no weights on either side: alike


def _row(shape: str, round_: int, tokens_per_s: float) -> dict:
    return {"point": "64x16", "shape": shape, "round": round_, "errors": 0,
            **{m: 1.0 for m in m3_load.METRICS}, "tokens_per_s": tokens_per_s}


def test_medians_and_ratios():
    rows = [_row(shape, r, rate) for r, rates in enumerate(((100.0, 80.0, 40.0, 90.0), (110.0, 70.0, 50.0, 95.0),
                                                            (90.0, 75.0, 45.0, 99.0)))
            for shape, rate in zip(m3_load.SHAPES, rates)]
    per_point = m3_load.medians(rows)
    assert per_point["64x16"]["dense"]["tokens_per_s"] == 100.0 and per_point["64x16"]["dense"]["rounds"] == 3
    assert per_point["64x16"]["all-in-one"]["tokens_per_s"] == 75.0
    r = m3_load.ratios(per_point)["64x16"]
    assert r["all_in_one_over_dense_tokens_per_s"] == pytest.approx(0.75)
    assert r["one_forward_over_three_requests_tokens_per_s"] == pytest.approx(75.0 / 45.0)
    assert r["sparse_over_dense_tokens_per_s"] == pytest.approx(0.95)
    assert m3_load.ratios({"1x1": {"dense": per_point["64x16"]["dense"]}})["1x1"][
        "all_in_one_over_dense_tokens_per_s"] is None


def _run(argv: list[str], out) -> None:
    """The scenario as `python -m bench serve m3` runs it; until bench/serve.py lists the scenario, its function
    called with the suite's arguments and a save() that writes the block as the suite's does."""
    if "m3" in serve.SCENARIOS:
        assert main(argv) == 0
        return
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    m3_load.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    head, settings = store.header(args.device, argv), m3_load.settings(args)

    def save(rows: list[dict], summary: dict, complete: bool) -> None:
        store.write(out, "serve", "cpu", "m3", store.block(head, settings, rows, summary, complete=complete))

    m3_load.m3_scenario(args, save)


@pytest.mark.slow
def test_the_scenario_end_to_end(tmp_path):
    from fusedserve.model.tokenizer import TextTokenizer

    out, cache, texts, max_words = tmp_path / "serve.json", tmp_path / "cache", 32, 12
    _run(["serve", "m3", "--device", "cpu", "--m3-shape", "tiny", "--m3-cache", str(cache), "--setting",
          "torch_threads=1", "--setting", "backend=torch", "--seconds", "1", "--warm-seconds", "0.2", "--texts",
          str(texts), "--max-words", str(max_words), "--m3-points", "1x2", "--m3-rounds", "1", "--client-processes",
          "1", "--log-dir", str(tmp_path), "--out", str(out)], out)
    doc = store.load(out)
    assert store.validate(doc) == [] and list(doc["scenarios"]) == ["m3"]
    block = doc["scenarios"]["m3"]
    assert block["complete"] and block["settings"]["points"] == ["1x2"] and block["settings"]["model_shape"] == "tiny"
    rows, summary = block["results"], block["summary"]

    # the model: built once into the cache, at the tiny shape; a second run finds it there
    model = summary["model"]
    assert model["dir"] == str(cache / "fusedserve-bench-bge-m3-tiny") and model["built_seconds"] > 0
    assert model["config"]["hidden_size"] == 64 and model["weights_dtypes"] == ["F32"]
    again = m3_load.prepare_model(argparse.Namespace(m3_model=None, m3_cache=str(cache), m3_shape="tiny"))
    assert again["built_seconds"] is None and again["dir"] == model["dir"]
    assert summary["info"]["models"][0]["outputs"] == ["pooled", "tokens", "colbert", "sparse"]

    # the same texts through every shape: one forward's outputs
    check = summary["same_forward"]
    assert check["same"] and check["texts"] == 4
    for name in ("dense_vs_dense_only", "dense_vs_three_requests", "multi_vector_vs_three_requests",
                 "sparse_vs_three_requests"):
        assert check[name]["same"] and check[name]["min_cosine"] >= m3_load.SAME_FORWARD_MIN_COSINE, (name, check)

    # every shape once at the one point, in SHAPES' order (round 1)
    assert [(r["round"], r["point"], r["shape"]) for r in rows] == [(0, "1x2", s) for s in m3_load.SHAPES]
    counts = [len(ids) for ids in TextTokenizer(Path(model["dir"]), 128).encode(mixed_texts(texts, low=5, high=max_words))]
    by_shape = {r["shape"]: r for r in rows}
    for r in rows:
        assert r["errors"] == 0 and r["iterations"] > 0 and r["p50_ms"] <= r["p99_ms"], r
        assert r["requests"] == r["iterations"] * r["requests_per_iteration"]
        assert r["texts_per_s"] * r["seconds"] == pytest.approx(r["iterations"] * 2)
        # tokens: the answers' usage, each text once (three-requests' too), so within the corpus's shortest and longest
        assert min(counts) <= r["tokens_per_text"] <= max(counts), (r, min(counts), max(counts))
        assert r["response_bytes_per_request"] > 0 and 0 < r["client_cpu_share"] <= 1 and r["server_cpu_cores"] > 0
    assert by_shape["three-requests"]["requests_per_iteration"] == 3
    # all three outputs weigh more on the wire than the dense vector or the sparse weights alone
    for alone in ("dense", "sparse"):
        assert by_shape["all-in-one"]["response_bytes_per_text"] > by_shape[alone]["response_bytes_per_text"]

    per_point = summary["medians"]["1x2"]
    assert set(per_point) == set(m3_load.SHAPES) and all(m["rounds"] == 1 for m in per_point.values())
    ratio = summary["ratios"]["1x2"]
    assert ratio["all_in_one_over_dense_tokens_per_s"] == pytest.approx(
        per_point["all-in-one"]["tokens_per_s"] / per_point["dense"]["tokens_per_s"])
    assert ratio["one_forward_over_three_requests_tokens_per_s"] == pytest.approx(
        per_point["all-in-one"]["tokens_per_s"] / per_point["three-requests"]["tokens_per_s"])
    assert (tmp_path / "serve-m3.log").is_file()
