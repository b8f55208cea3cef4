"""Every PromQL expression of the Grafana dashboard and of the alert rules, run through a real Prometheus
that scrapes the real server after traffic, must return data: a renamed metric or label breaks this test.
Alert expressions are run without their final threshold (and `absent(...)` without the wrapper), so what
is checked is that the series they watch exist. Dashboard variables become match-all regexes."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import require_tool
from tests.server.conftest import admin_headers, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]

# Expected to be empty in this CPU test run, with the reason.
EXPECTED_EMPTY = {
    "fusedserve_device_memory_bytes": "GPU memory is only reported on CUDA devices",
}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/fusedserve.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$job", ".*").replace("$instance", ".*")
                    .replace("$__rate_interval", "1m"))
            out.append((f"dashboard: {panel['title']} [{target['refId']}]", expr))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    out = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"].strip()
            absent = re.fullmatch(r"absent\((.*)\)", expr, re.S)
            if absent:
                expr = absent.group(1)
            else:
                expr = re.sub(r"\s*(>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*$", "", expr)
            out.append((f"alert: {rule['alert']}", expr))
    return out


@pytest.fixture(scope="module")
def prometheus_with_traffic(tmp_path_factory):
    # the Debian package prometheus; CI installs it and sets FUSEDSERVE_REQUIRE_PROMETHEUS=1: no skipping there
    prometheus = require_tool("prometheus", "FUSEDSERVE_REQUIRE_PROMETHEUS")
    tmp = tmp_path_factory.mktemp("promql")
    server = start_server(tmp, verify_sample_rate=1.0, kernel_timing_sample_rate=1.0, faults=True,
                          max_queue=2, max_batch_requests=1, max_wait_ms=0)
    target = server.url.removeprefix("http://")
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        f"  - job_name: fusedserve\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(expr: str) -> list:
        r = httpx.get(api, params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if query('up{job="fusedserve"} == 1'):
                    break
            except (httpx.HTTPError, AssertionError, ValueError):  # ValueError: a starting Prometheus answers a
                pass  # plain-text 503 "Service Unavailable" until its storage is ready (not JSON)
            assert time.monotonic() < deadline, "Prometheus never scraped the server"
            time.sleep(0.5)
        # traffic, including a rejection, so that every series the expressions read exists
        sent = 8
        for i in range(sent):
            r = httpx.post(server.url + "/infer", json={"inputs": [f"sentence {i}", "word " * (i * 5 + 1)]}, timeout=60)
            assert r.status_code == 200, r.text
        httpx.post(server.url + "/admin/faults", json={"op": "embedding_layer_norm", "mode": "delay", "factor": 1.0},
                   headers=admin_headers())
        bodies = [{"inputs": ["a"]}, {"inputs": ["b", "c"]}, {"inputs": ["d"]}]

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/infer", json=b) for b in bodies))

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert 429 in statuses
        sent += len(bodies)
        # the server has recorded the traffic: every request counted (as its response ends, which the client may see
        # first), and a sampled batch's kernel timings (taken after its answer, once the worker is idle)
        deadline = time.monotonic() + 60
        while not _recorded(httpx.get(server.url + "/metrics", timeout=10).text, sent):
            assert time.monotonic() < deadline, "the server's /metrics never showed the traffic"
            time.sleep(0.1)
        # then two scrapes: rate() and increase() need two samples of a series in their window, and a series the
        # last request created has them once Prometheus has scraped twice since
        recorded = time.time()  # Prometheus stamps a sample with its scrape's start, on the same clock
        deadline = time.monotonic() + 60
        while (scrapes := _scrapes_since(query, recorded)) < 2:
            assert time.monotonic() < deadline, f"{scrapes} scrapes of the server in 60 s"
            time.sleep(0.2)
        yield query
    finally:
        prom.terminate()
        prom.wait(timeout=20)
        server.stop()


def _recorded(metrics: str, requests: int) -> bool:
    """The exposition counts `requests` answers on /infer and holds a kernel timing."""
    answered = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("fusedserve_requests_total{") and 'route="/infer"' in line)
    return answered >= requests and "fusedserve_kernel_duration_seconds_count{" in metrics


def _scrapes_since(query, since: float) -> int:
    """How many scrapes of the server Prometheus holds that started after `since` (seconds since the epoch)."""
    series = query('up{job="fusedserve"}[1m]')
    return sum(float(stamp) > since for s in series for stamp, _ in s["values"])


@pytest.mark.parametrize("name,expr", dashboard_exprs() + alert_exprs(), ids=lambda v: v if len(v) < 60 else None)
def test_expression_returns_data(prometheus_with_traffic, name, expr):
    empty_reason = next((why for metric, why in EXPECTED_EMPTY.items() if metric in expr), None)
    result = prometheus_with_traffic(expr)
    if empty_reason:
        assert result == [], f"{name}: expected empty ({empty_reason}) but got data; update EXPECTED_EMPTY"
    else:
        assert result, f"{name}: no data for {expr}"


def test_alert_list_covers_the_contract():
    names = {n.removeprefix("alert: ") for n, _ in alert_exprs()}
    assert names == {"FusedserveReferenceMismatch", "FusedserveFallback", "FusedservePrecisionFallback",
                     "FusedserveHighLatency",
                     "FusedserveQueueSaturated", "FusedserveRejecting", "FusedserveDown"}
