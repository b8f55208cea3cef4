"""PRECISION=fp8 on the GPU's FP8 tensor cores: the real MiniLM against sentence-transformers in fp32 (the quantizing
kernels on the device, the GEMMs through torch._scaled_mm, inside CUDA graphs), the fallback tier dropping the graphs
and answering as the fp16 path does, and the real server's guard: sustained FP8 mismatches move the model back to its
fp16 fused path, counted and reported, without touching the reference fallback."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch

from fusedserve.kernels import fp8
from fusedserve.model.config import EncoderConfig
from fusedserve.model.families import family
from fusedserve.model.runner import Embedder
from tests.gpu.test_minilm_gpu import _model_dir
from tests.gpu.test_server_gpu import GPU_READY_S
from tests.model.sentences import SENTENCES
from tests.server.conftest import start_server
from tests.tolerances import FP8_QUANTIZATION, assert_embeddings_close, embedding_errors, tolerance
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu

needs_fp8 = pytest.mark.skipif(torch.cuda.is_available() and fp8.unavailable(torch.device("cuda")) is not None,
                               reason="this GPU has no FP8 tensor cores")


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(_model_dir()), device="cuda").float()
    return torch.from_numpy(st.encode(SENTENCES, batch_size=32, convert_to_numpy=True))


@needs_fp8
def test_minilm_in_fp8_against_sentence_transformers(reference, record_property):
    embedder, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", precision="fp8")
    assert embedder.kernel_path.active_precision == "fp8" and embedder.graphs is not None
    ours = torch.cat([embedder.embed(SENTENCES[i: i + 32]) for i in range(0, len(SENTENCES), 32)])
    cosine, max_abs = assert_embeddings_close(ours, reference, torch.float8_e4m3fn, what="fp8, batches of 32")
    record_property("min_cosine", cosine)
    native, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16")
    fp16 = torch.cat([native.embed(SENTENCES[i: i + 32]) for i in range(0, len(SENTENCES), 32)])
    print(f"\nfp8: min cosine {cosine:.6f}, max abs {max_abs:.2e}; fp16: {embedding_errors(fp16, reference)}")
    assert cosine < embedding_errors(fp16, reference)[0]  # the batches did run in FP8

    # the tier: graphs re-captured on the fp16 path, answers as the fp16 model's
    assert embedder.kernel_path.fall_back_precision("fp8_mismatch")
    again = torch.cat([embedder.embed(SENTENCES[i: i + 32]) for i in range(0, len(SENTENCES), 32)])
    assert_embeddings_close(again, fp16, "float16", what="after the fallback tier")
    embedder.kernel_path.set_fused(True)
    back = torch.cat([embedder.embed(SENTENCES[i: i + 32]) for i in range(0, len(SENTENCES), 32)])
    assert_embeddings_close(back, ours, "float16", what="fp8 again after the fused switch")


@needs_fp8
def test_mpnet_in_fp8_on_the_gpu(monkeypatch):
    # MPNet's relative-bias attention between FP8 GEMMs (model/mpnet.py), replayed from CUDA graphs; its weights are
    # random (the real ones are over the GPU machine's carry limit), so the reference is the same model in fp16, fed
    # token ids (a preset borrows the packaged model's tokenizer, which the GPU machine lacks)
    config = EncoderConfig.from_name("mpnet-base")
    embedder = Embedder(family(config).encoder(config), None, "mpnet-base", device=torch.device("cuda"),
                        dtype=torch.float16, precision="fp8")
    embedder.kernel_path.set_fused(True)  # the kernel selection (Embedder.load makes it)
    assert embedder.kernel_path.active_precision == "fp8" and embedder.graphs is not None
    calls = []
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda *args: calls.append(args[2]) or linear(*args))
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randint(5, config.vocab_size, (n,), generator=gen).tolist() for n in (7, 200, 128, 41, 1)]
    ours = embedder.embed_ids(rows)  # captured on first use: the FP8 GEMMs run while Python looks, then replayed
    assert len(calls) >= 4 * config.num_layers
    assert embedder.graphs.stats()["replays"] >= 1
    assert embedder.kernel_path.fall_back_precision("test")
    fp16 = embedder.embed_ids(rows)
    assert_embeddings_close(ours, fp16, torch.float8_e4m3fn, what="MPNet, random weights, against its fp16 path")
    assert embedding_errors(ours, fp16)[0] < tolerance(torch.float16).min_cosine  # the batch did run in FP8


@needs_fp8
def test_fp8_kernels_against_the_gpus_own_conversion():
    gen = torch.Generator().manual_seed(5)
    for cols in (384, 1536, 3072, 4097):
        x = (torch.randn(300, cols, generator=gen) * 3).to("cuda", torch.float16)
        q, s = fp8.quantize_rows(x)
        hardware = (x.float() / s).to(torch.float8_e4m3fn)  # the device's own cvt: nearest even, saturating
        assert float((q.float() == hardware.float()).double().mean()) >= FP8_QUANTIZATION.min_same_as_device
        assert fp8.quantization_error(q, s, x) <= FP8_QUANTIZATION.max_rounding_error


@needs_fp8
def test_gpu_server_guard_moves_sustained_fp8_mismatches_to_fp16(tmp_path):
    # a tolerance no FP8 batch meets: every check mismatches, the third moves the model
    server = start_server(tmp_path, ready_timeout_s=GPU_READY_S, model=str(_model_dir().resolve()), device="cuda",
                          dtype="float16", precision="fp8", verify_sample_rate="1", verify_action="fallback",
                          verify_tolerance_fp8="1e-9")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            def counted() -> str | None:  # /metrics once it counts the move
                text = client.get("/metrics").text
                return text if 'reason="fp8_mismatch"} 1.0' in text else None

            def unchecked() -> float:  # batches served and not checked yet (verify_sample_rate=1: it checks each)
                lines = client.get("/metrics").text.splitlines()
                batches, checks = (sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series))
                                   for series in ("fusedserve_batch_size_count{", "fusedserve_reference_checks_total{"))
                return batches - checks

            before = client.get("/info").json()
            assert before["precision"] == {"requested": "fp8", "active": "fp8", "fallback": None}
            assert "fusedserve_fp8_enabled{model=" in client.get("/metrics").text
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                client.post("/infer", json={"inputs": SENTENCES[:32]})
                info = client.get("/info").json()
                if info["precision"]["active"] == "native":
                    break
            assert info["precision"] == {"requested": "fp8", "active": "native", "fallback": "fp8_mismatch"}, info
            # /info reports the move as the model makes it; the count follows within the same step
            metrics = wait_until(counted, 30, "no fp8_mismatch precision fallback counted in /metrics")
            # later batches are checked at the fp16 tolerance, and match: no reference fallback follows
            for _ in range(5):
                assert client.post("/infer", json={"inputs": SENTENCES[:32]}).status_code == 200
            # the verifier checks each batch on its own thread after the answer: /info once it has checked them all
            wait_until(lambda: unchecked() <= 0, 60, lambda: f"{unchecked():g} batches not checked yet")
            after = client.get("/info").json()
    finally:
        assert server.stop() in (0, -signal.SIGTERM), server.log()[-3000:]
    assert after["fused"] is True and after["fallback"] is None, after
    assert 'fusedserve_precision_fallbacks_total{model="' in metrics and 'reason="fp8_mismatch"} 1.0' in metrics
    assert any(line.startswith("fusedserve_fp8_enabled{") and line.endswith(" 0.0") for line in metrics.splitlines())
    assert "precision fallback: the GEMMs of" in server.log()
