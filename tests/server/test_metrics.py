"""/metrics after real traffic: every family of the contract with sensible values, `promtool check
metrics` clean, and a real Prometheus scraping the real server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import require_tool
from tests.server.conftest import free_port
from tests.tolerances import tolerance

FAMILIES = [
    "fusedserve_requests_total", "fusedserve_request_duration_seconds", "fusedserve_queue_duration_seconds",
    "fusedserve_queue_depth", "fusedserve_rejected_requests_total", "fusedserve_batch_size",
    "fusedserve_batch_tokens", "fusedserve_batch_padding_ratio", "fusedserve_kernel_duration_seconds",
    "fusedserve_forward_duration_seconds", "fusedserve_reference_checks_total", "fusedserve_reference_max_abs_error",
    "fusedserve_reference_cosine_distance", "fusedserve_fallbacks_total", "fusedserve_backend_info",
    "fusedserve_fused_enabled",
]


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    from tests.server.conftest import start_server

    server = start_server(tmp_path_factory.mktemp("metrics"), verify_sample_rate=1.0, kernel_timing_sample_rate=1.0)
    for i in range(5):
        assert httpx.post(server.url + "/infer", json={"inputs": [f"sentence number {i}", "x " * (10 * i + 1)]},
                          timeout=60).status_code == 200
    httpx.post(server.url + "/infer", json={"inputs": []})
    deadline = time.monotonic() + 20  # the verifier and the sampled batches' op timings run in the background
    while 'fusedserve_reference_checks_total{model="all-MiniLM-L6-v2",result="match"} 0.0' in (
            text := httpx.get(server.url + "/metrics").text) or "fusedserve_kernel_duration_seconds_count{" not in text:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    yield server
    server.stop()


MODEL = "all-MiniLM-L6-v2"


def _samples(text: str) -> dict[str, float]:
    """Each sample by its name and labels as the exposition writes them, labels sorted: name{a="1",b="2"}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_every_family_with_sensible_values(busy_server):
    text = httpx.get(busy_server.url + "/metrics").text
    for family in FAMILIES:
        assert f"# TYPE {family.removesuffix('_total')} " in text or f"# TYPE {family} " in text, family
    s = _samples(text)
    m = f'model="{MODEL}"'
    assert s[f'fusedserve_requests_total{{{m},route="/infer",status="200"}}'] == 5
    assert s[f'fusedserve_requests_total{{{m},route="/infer",status="400"}}'] == 1  # no inputs, to the model
    assert s[f"fusedserve_batch_size_count{{{m}}}"] >= 1 and s[f"fusedserve_batch_size_sum{{{m}}}"] == 10
    assert 0 < s[f"fusedserve_batch_padding_ratio_sum{{{m}}}"] < s[f"fusedserve_batch_padding_ratio_count{{{m}}}"]
    batches = s[f"fusedserve_batch_size_count{{{m}}}"]
    assert s[f'fusedserve_forward_duration_seconds_count{{{m},path="fused"}}'] == batches
    layers = 6
    kernel = "fusedserve_kernel_duration_seconds_count"
    # every batch is sampled; one sample waits for its timing at a time, so `timed` of them were: each op per forward
    timed = s[f'{kernel}{{backend="torch",{m},op="embedding_layer_norm"}}']
    assert 1 <= timed <= batches
    # the GEMM blocks on the CPU backend, the rest on the reference
    assert s[f'{kernel}{{backend="cpu",{m},op="linear_add_layer_norm"}}'] == 2 * layers * timed
    assert s[f'{kernel}{{backend="cpu",{m},op="linear_bias_gelu"}}'] == layers * timed
    assert s[f'fusedserve_reference_checks_total{{{m},result="match"}}'] >= 1
    assert s[f'fusedserve_reference_checks_total{{{m},result="mismatch"}}'] == 0
    assert 0 <= s[f"fusedserve_reference_max_abs_error{{{m}}}"] <= tolerance().max_abs  # the verifier's fp32 copy
    assert s[f'fusedserve_backend_info{{backend="cpu",{m},op="linear_bias_gelu"}}'] == 1
    assert not any('op="bias_gelu"' in k for k in s if k.startswith("fusedserve_backend_info"))  # not called
    assert s[f"fusedserve_fused_enabled{{{m}}}"] == 1 and s[f"fusedserve_model_ready{{{m}}}"] == 1
    assert s[f"fusedserve_queue_depth{{{m}}}"] == 0
    # CUDA-graph families exist on the CPU too (no graphs here: all zero), so dashboards see the series
    assert s[f"fusedserve_cuda_graphs{{{m}}}"] == 0 and s[f"fusedserve_cuda_graph_captures_total{{{m}}}"] == 0
    assert s[f"fusedserve_cuda_graph_replays_total{{{m}}}"] == 0
    assert s[f"fusedserve_cuda_graph_eager_fallbacks_total{{{m}}}"] == 0
    # every series of a model's work says which model: only the requests no model was chosen for have none
    # the device's series are the process's, as the device memory is
    unlabelled = {k for k in s if k.startswith("fusedserve_") and "model=" not in k
                  and not k.startswith("fusedserve_device_")}
    assert not unlabelled, unlabelled
    assert s['fusedserve_device_workers{device="cpu"}'] == 1
    assert 0 < s['fusedserve_device_busy_seconds_total{device="cpu"}']
    # the batches' real tokens: some, and no more than the padded tokens the batch histogram counts
    assert 0 < s['fusedserve_device_tokens_total{device="cpu"}'] <= s[f"fusedserve_batch_tokens_sum{{{m}}}"]


# promtool and prometheus come with the Debian package prometheus; CI installs it and sets
# FUSEDSERVE_REQUIRE_PROMETHEUS=1, so there these tests never skip.


def test_promtool_check_metrics_is_clean(busy_server):
    promtool = require_tool("promtool", "FUSEDSERVE_REQUIRE_PROMETHEUS")
    text = httpx.get(busy_server.url + "/metrics").text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "" and result.stderr.strip() == "", \
        result.stdout + result.stderr


def test_real_prometheus_scrapes_the_server(busy_server, tmp_path):
    prometheus = require_tool("prometheus", "FUSEDSERVE_REQUIRE_PROMETHEUS")
    target = busy_server.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        f"  - job_name: fusedserve\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query"
        deadline = time.monotonic() + 60
        value = None
        while time.monotonic() < deadline:
            try:
                # a starting Prometheus answers its API with a plain-text 503 until /-/ready does
                response = httpx.get(api, params={"query": 'sum(fusedserve_requests_total{route="/infer"})'}, timeout=2)
                r = response.raise_for_status().json()
                if r["data"]["result"]:
                    value = float(r["data"]["result"][0]["value"][1])
                    break
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.5)
        assert value is not None and value >= 6
        up = httpx.get(api, params={"query": 'up{job="fusedserve"}'}).json()["data"]["result"]
        assert up and up[0]["value"][1] == "1"
        q = "histogram_quantile(0.99, sum by (le) (fusedserve_request_duration_seconds_bucket))"
        p99 = httpx.get(api, params={"query": q}).json()["data"]["result"]
        assert p99 and float(p99[0]["value"][1]) > 0
    finally:
        prom.terminate()
        prom.wait(timeout=20)
