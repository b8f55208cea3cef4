"""The real server on the GPU with every sampled path switched on (kernel timing on every batch with CUDA events,
reference verification of every batch with the fp32 copy on the GPU, device-memory gauges, CUDA graphs):
answers are right, the metrics are populated, /info shows the graphs."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fusedserve.model.packing import varlen_attention
from tests.gpu.test_minilm_gpu import _model_dir
from tests.model.sentences import SENTENCES
from tests.server.conftest import start_server
from tests.tolerances import assert_embeddings_close, tolerance

pytestmark = pytest.mark.gpu
# a GPU server's start on a cold Triton cache: self-tests, races and autotuning of every op it calls, then the
# warm-up's ~200 graph captures (minutes on a cold machine, more beside other test processes compiling)
GPU_READY_S = 480


MATCHES = "fusedserve_reference_checks_total", 'result="match"'


def _counted(metrics: str, series: tuple[str, str]) -> bool:
    name, label = series
    return any(line.startswith(name + "{") and label in line and not line.endswith(" 0.0")
               for line in metrics.splitlines())


def test_gpu_server_with_timing_verification_and_graphs(tmp_path):
    server = start_server(tmp_path, ready_timeout_s=GPU_READY_S, model=str(_model_dir().resolve()), device="cuda",
                          dtype="float16", kernel_timing_sample_rate="1", verify_sample_rate="1",
                          verify_action="fallback", max_batch_tokens="8192")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            single = [client.post("/infer", json={"inputs": [t]}).json()["embeddings"][0] for t in SENTENCES[:8]]
            batch = client.post("/infer", json={"inputs": SENTENCES[:8]}).json()["embeddings"]
            assert_embeddings_close(batch, single, "float16", what="batched vs alone")
            info = client.get("/info").json()
            # the verifier and the sampled batches' op timings run in the background: poll for both
            deadline = time.monotonic() + 120
            while not (_counted(metrics := client.get("/metrics").text, MATCHES)
                       and "fusedserve_kernel_duration_seconds_count{" in metrics) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        # uvicorn re-raises the captured SIGTERM once its graceful shutdown is complete
        assert server.stop() in (0, -signal.SIGTERM), server.log()[-3000:]
    assert "all accepted requests answered" in server.log()
    assert "buckets captured before ready" in server.log()  # the startup report, in order of need
    assert info["device"].startswith("cuda") and info["fused"] is True and info["fallback"] is None
    assert info["layout"] == "packed" and info["cuda_graphs"]["max_graphs"] == 256
    # fp16 on CUDA, Triton here: auto takes the few-token layer (<= 64 tokens) with varlen above
    assert info["attention"] == ("fused" if varlen_attention() else "pad"), info["attention_reason"]
    assert "few-token layer" in info["attention_reason"] or not varlen_attention()
    backends = {op["backend"] for op in info["kernels"].values() if op.get("used", True)}
    assert backends <= {"triton", "cuda"}
    # warm-up ran the largest batch: a CUDA op with tuned launches (segment_mean has one fixed launch) reports them
    if {name for name, op in info["kernels"].items() if op.get("used", True) and op["backend"] == "cuda"} - {
            "segment_mean"}:
        assert info["cuda_launch_configs"] and all("config" in v for v in info["cuda_launch_configs"].values())
    timed = [line for line in metrics.splitlines()
             if line.startswith("fusedserve_kernel_duration_seconds_count") and not line.endswith(" 0.0")]
    assert timed, "no kernel timings recorded on the GPU"
    assert any(b in " ".join(timed) for b in backends)
    checks = [line for line in metrics.splitlines() if line.startswith("fusedserve_reference_checks_total")]
    assert any('result="match"' in line and not line.endswith(" 0.0") for line in checks), checks
    assert not any('result="mismatch"' in line and not line.endswith(" 0.0") for line in checks), checks
    graph_lines = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("fusedserve_cuda_graph")}  # one model: one series each
    assert graph_lines["fusedserve_cuda_graph_captures_total"] >= 1  # the warm-up batch at least
    assert graph_lines["fusedserve_cuda_graph_pool_bytes"] > 0
    memory = [line for line in metrics.splitlines() if line.startswith("fusedserve_device_memory_bytes")]
    assert memory and any(float(line.rsplit(" ", 1)[1]) > 0 for line in memory), memory
    print("\n" + "\n".join(timed[:12] + checks + memory))


def test_gpu_server_overlapped_batches_answer_their_own_requests(tmp_path):
    # the serving defaults (no timing, no verification: batches replay graphs, or run eagerly while their bucket
    # waits for its capture after ready, and overlap_batches holds one in flight); small batches so that many follow
    # each other while 48 requests of distinct texts are in flight. One request of every distinct text queues several
    # batches at once, so a batch is launched while another is in flight however the concurrent requests happen to
    # arrive (whether they overlap depends on the machine's timing)
    server = start_server(tmp_path, ready_timeout_s=GPU_READY_S, model=str(_model_dir().resolve()), device="cuda",
                          dtype="float16", kernel_timing_sample_rate="0", max_batch_requests="4")
    requests = [[SENTENCES[i % len(SENTENCES)], SENTENCES[(7 * i + 3) % len(SENTENCES)]] for i in range(48)]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            alone = {t: client.post("/infer", json={"inputs": [t]}).json()["embeddings"][0]
                     for t in {t for r in requests for t in r}}
            every = sorted(alone)
            together = client.post("/infer", json={"inputs": every}).json()["embeddings"]

            def post(texts):
                with httpx.Client(base_url=server.url, timeout=60) as c:
                    return c.post("/infer", json={"inputs": texts}).json()["embeddings"]

            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(post, requests * 3))
            info = client.get("/info").json()
    finally:
        assert server.stop() in (0, -signal.SIGTERM), server.log()[-3000:]
    assert info["batching"]["overlap_batches"] is True
    assert len(every) > 4 and info["batching"]["overlapped"] > 0, info["batching"]  # batches were launched ahead
    assert info["cuda_graphs"]["replays"] > 0, info["cuda_graphs"]
    for texts, got in [*zip(requests * 3, answers), (every, together)]:
        assert len(got) == len(texts)
        for text, vector in zip(texts, got):
            own = sum(x * y for x, y in zip(vector, alone[text]))
            nearest_other = max(sum(x * y for x, y in zip(vector, alone[t])) for t in alone if t != text)
            # its own text's embedding (distinct texts here are at most 0.99 alike in MiniLM, so a swap fails)
            assert own >= tolerance("float16").min_cosine and own > nearest_other, (text, own, nearest_other)
