"""`python -m bench encoder` end to end on the CPU (the tiny preset): eager PyTorch (transformers' BertModel) and
ours on the same token ids, into a valid results block. It asserts structure, never a time."""

from __future__ import annotations

import torch

from bench import encoder as suite
from bench import results as store
from bench.__main__ import main



def test_tiny_case_against_eager_pytorch(tmp_path):
    out = tmp_path / "encoder.json"
    assert main(["encoder", "tiny-b3-varlen", "--device", "cpu", "--providers", "torch eager", "ours",
                 "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    block = doc["scenarios"]["tiny-b3-varlen"]
    assert block["complete"] and block["settings"]["lengths"] == suite.lengths_for(3, 12, True)
    rows = {(r["provider"], r.get("mode")): r for r in block["results"]}
    assert set(rows) == {("torch eager", None), ("ours", "eager")}
    lengths = block["settings"]["lengths"]
    for r in rows.values():
        assert r["ms"] > 0 and r["tokens"] == sum(lengths) and r["padded_tokens"] == 3 * max(lengths)
    ours = rows[("ours", "eager")]
    assert ours["backend"] == "auto" and ours["kernels"]  # what the registry chose, per op


def test_the_cross_encoder_case_runs_a_classifier_beside_transformers(tmp_path):
    out = tmp_path / "encoder.json"
    assert main(["encoder", "tiny-cross-encoder-b3-varlen", "--device", "cpu", "--providers", "torch eager", "ours",
                 "--out", str(out)]) == 0
    block = store.load(out)["scenarios"]["tiny-cross-encoder-b3-varlen"]
    assert block["complete"] and block["settings"]["head"] == "classifier"
    assert {r["provider"] for r in block["results"] if "error" not in r} == {"torch eager", "ours"}


def test_xlm_roberta_base_preset_matches_transformers_shape():
    model = suite.hf_model(__import__("fusedserve.model.config", fromlist=["EncoderConfig"]).EncoderConfig.from_name(
        "xlm-roberta-base").replace(num_layers=1), "cpu", __import__("torch").float32)
    assert type(model).__name__ == "XLMRobertaModel" and model.config.vocab_size == 250002


def test_rows_and_floor():
    rows = suite.token_rows([4, 7], vocab_size=30522)
    assert [len(r) for r in rows] == [4, 7] and all(r[0] == 101 and r[-1] == 102 for r in rows)
    config = __import__("fusedserve.model.config", fromlist=["EncoderConfig"]).EncoderConfig.from_name("tiny")
    h, inner, layers = config.hidden_size, config.intermediate_size, config.num_layers
    assert suite.gemm_flops(config, [2, 3]) == layers * (2 * 5 * (4 * h * h + 2 * h * inner) + 4 * (4 + 9) * h)
    # a gated FFN-in is twice as wide; a sliding-window layer's queries meet at most 2 x window + 1 keys
    gated = config.replace(architecture="gte")
    assert suite.gemm_flops(gated, [2, 3]) == layers * (2 * 5 * (4 * h * h + 3 * h * inner) + 4 * (4 + 9) * h)
    local = config.replace(architecture="modernbert", num_layers=3, sliding_layers=(1, 2), sliding_window=1)
    assert suite.gemm_flops(local, [2, 5]) == (3 * 2 * 7 * (4 * h * h + 3 * h * inner) + 4 * (4 + 25) * h
                                               + 2 * 4 * (2 * 2 + 5 * 3) * h)
    assert suite.category("nvjet_hsh_64x8_gemm") == "gemm" and suite.category("flash_fwd_kernel") == "attention"
    assert suite.category("_add_layer_norm_kernel") == "norm"


def test_interleaved_timing_alternates_the_order_every_round():
    """Each round times every callable, in an order reversed every round (drift in the process falls on all alike),
    and each gets a positive median."""
    import itertools

    log: list[str] = []
    fns = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    times = suite.interleaved_ms(fns, "cpu")
    assert set(times) == {"a", "b", "c"} and all(t > 0 for t in times.values())
    runs = [name for name, _ in itertools.groupby(log)]
    calibration, rounds = runs[:3], runs[3:]
    assert calibration == ["a", "b", "c"]
    # five rounds on the CPU: a b c | c b a | a b c ... (adjacent equal names merge across a round's boundary)
    assert rounds == ["a", "b", "c", "b", "a", "b", "c", "b", "a", "b", "c"]


def test_top10_overlap_counts_shared_neighbours():
    from bench.encoder import top10_overlap

    gen = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(60, 16, generator=gen), dim=1)
    assert top10_overlap(e, e) == 1.0
    # a text's own row is never its neighbour: a copy of the set with every row moved far away shares nothing
    noise = torch.nn.functional.normalize(torch.randn(60, 16, generator=gen), dim=1)
    assert top10_overlap(noise, e) < 0.5
    slight = torch.nn.functional.normalize(e + 0.01 * torch.randn(60, 16, generator=gen), dim=1)
    assert 0.9 <= top10_overlap(slight, e) <= 1.0


def test_the_report_labels_fp8_rows_and_renders_the_accuracy_block():
    from bench import report

    assert report.encoder_label({"provider": "ours", "backend": "auto", "mode": "graphs", "precision": "fp8"}) == \
        "ours FP8, CUDA graphs"
    assert report.encoder_label({"provider": "ours", "backend": "auto", "mode": "graphs"}) == "ours, CUDA graphs"
    table = report.fp8_accuracy_table({"results": [
        {"precision": "native", "min_cosine": 1.0, "p01_cosine": 1.0, "mean_cosine": 1.0, "top10_overlap": 0.9992},
        {"precision": "fp8", "min_cosine": 0.99456, "p01_cosine": 0.99645, "mean_cosine": 0.997652,
         "top10_overlap": 0.9435}]})
    assert "| fp8 | 0.99456 | 0.99645 | 0.997652 | 0.9435 |" in table


def test_runtime_calls_are_summed_per_forward_by_name_without_the_waits():
    """The profile's host time in CUDA calls: CPU-side cuda*/cu* events per forward, largest first; the waits and
    the device's own events are not host work."""
    from types import SimpleNamespace

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, us, device=cpu):
        return SimpleNamespace(name=name, cpu_time_total=us, device_type=device)

    events = [event("cudaGraphLaunch", 30.0), event("cudaGraphLaunch", 34.0), event("cudaMemcpyAsync", 6.0),
              event("cudaMemcpyAsync", 4.0), event("cuLaunchKernel", 2.0), event("cudaEventSynchronize", 900.0),
              event("aten::copy_", 50.0), event("cudaGraphLaunch", 77.0, gpu)]
    assert suite.runtime_calls_us(events, iters=2) == {"cudaGraphLaunch": 32.0, "cudaMemcpyAsync": 5.0,
                                                        "cuLaunchKernel": 1.0}
    assert list(suite.runtime_calls_us(events, iters=2, top=1)) == ["cudaGraphLaunch"]
