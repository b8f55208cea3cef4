"""The serving suite's `cpu` scenario: the question a CPU user asks first. Is the server, on the same cores as its
load client, faster than calling sentence-transformers in-process? Same texts, same run, rounds alternating between
the peers and each server configuration; medians of the rounds.

Peers, in this process: `SentenceTransformer.encode(batch_size=32)` in fp32, and its ONNX backend where onnxruntime
(and what sentence-transformers needs to export the model) imports; a peer that cannot run is recorded with the
reason. Per server configuration (fp32 with the defaults, the bfloat16 path where the CPU has instructions for it,
WORKERS=2): its time to ready, then per round closed-loop load from --cpu-clients clients of --per-request texts on
keep-alive connections (the client's own CPU time reported beside), then one text at a time (p50 / p99) against
sentence-transformers encoding one text at a time, and the lowest cosine to sentence-transformers over held-out
texts."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import httpx

from bench.harness import load, log_path, min_cosine, mixed_texts, percentiles_ms, running_servers, server_settings

CONFIGS = {"fp32": {}, "bfloat16": {"dtype": "bfloat16"}, "workers-2": {"workers": "2"}}
HELD_OUT = 32  # texts each configuration's vectors are checked on


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="cpu: the server configurations (bfloat16 is skipped, saying why, on a CPU without "
                             "its instructions)")
    parser.add_argument("--cpu-clients", type=int, default=4, help="cpu: keep-alive clients of the closed loop")
    parser.add_argument("--rounds", type=int, default=3, help="cpu: rounds alternating the peers and the server")
    parser.add_argument("--one-text-count", type=int, default=50, help="cpu: single texts timed one at a time")


def _model_dir(args: argparse.Namespace) -> Path:
    from fusedserve.model.config import PRESETS
    from fusedserve.model.weights import default_model_dir

    if args.model in PRESETS:
        raise SystemExit("cpu: sentence-transformers loads a checkpoint directory; a preset (random init) has none")
    return default_model_dir() if args.model == "default" else Path(args.model).resolve()


def _peers(path: Path) -> dict:
    """{name: SentenceTransformer or the reason it cannot run}."""
    from sentence_transformers import SentenceTransformer

    peers: dict = {"sentence-transformers": SentenceTransformer(str(path), device="cpu")}
    if importlib.util.find_spec("onnxruntime") is None:
        peers["sentence-transformers onnx"] = "onnxruntime is not installed (pip install 'fusedserve[bench]')"
    else:
        try:
            peers["sentence-transformers onnx"] = SentenceTransformer(str(path), device="cpu", backend="onnx")
        except Exception as error:  # noqa: BLE001 - any failure to export or load is the peer's, recorded
            peers["sentence-transformers onnx"] = f"{type(error).__name__}: {str(error)[:200]}"
    return peers


def _encode_rate(model, texts: list[str]) -> float:
    started = time.perf_counter()
    model.encode(texts, batch_size=32)
    return len(texts) / (time.perf_counter() - started)


def _one_text_ms(encode, texts: list[str]) -> dict:
    latencies = []
    for text in texts:
        started = time.perf_counter()
        encode(text)
        latencies.append(time.perf_counter() - started)
    return percentiles_ms(latencies)


def _served_vectors(client: httpx.Client, texts: list[str], model: str) -> list[list[float]]:
    r = client.post("/v1/embeddings", json={"input": texts, "model": model})
    r.raise_for_status()
    return [row["embedding"] for row in r.json()["data"]]


def _closed_loop(url: str, texts: list[str], args: argparse.Namespace) -> dict:
    """One closed-loop point from this process (one event loop: the load client), with its CPU time."""
    cpu = time.process_time()
    run = load(url, texts, args.cpu_clients, args.seconds, args.per_request, payload="openai")
    client_cpu = time.process_time() - cpu
    texts_done = len(run["latencies"]) * args.per_request
    return {"texts_per_s": texts_done / run["elapsed"], "requests": len(run["latencies"]), "errors": run["errors"],
            "seconds": run["elapsed"], "client_cpu_s": client_cpu, **percentiles_ms(run["latencies"])}


def _supported(config: str) -> str | None:
    """Why a configuration cannot run on this machine, or None."""
    if config == "bfloat16":
        import torch

        from fusedserve.model.loading import CPU_HALF_FLAGS, cpu_half_isa

        if not cpu_half_isa(torch.bfloat16):
            return f"this CPU has none of {', '.join(CPU_HALF_FLAGS[torch.bfloat16])}"
    return None


def cpu_scenario(args: argparse.Namespace, save) -> None:
    if args.device != "cpu":
        raise SystemExit("cpu: a scenario of the CPU device (--device cpu)")
    texts = mixed_texts(args.texts, low=min(5, args.max_words), high=args.max_words)
    held = mixed_texts(HELD_OUT, seed=1, low=min(5, args.max_words), high=args.max_words)
    singles = texts[: args.one_text_count]
    peers = _peers(_model_dir(args))
    st = peers["sentence-transformers"]
    reference = st.encode(held, batch_size=32)
    for model in (m for m in peers.values() if not isinstance(m, str)):
        model.encode(texts[:64], batch_size=32)  # warm
    summary: dict = {"texts": len(texts), "held_out": len(held), "clients": args.cpu_clients,
                     "per_request": args.per_request, "rounds": args.rounds,
                     "unavailable": {n: m for n, m in peers.items() if isinstance(m, str)},
                     "peers": {}}
    peer_rounds: dict[str, list[float]] = {n: [] for n, m in peers.items() if not isinstance(m, str)}
    summary["sentence_transformers_one_text"] = _one_text_ms(lambda t: st.encode([t]), singles)
    onnx = peers["sentence-transformers onnx"]
    if not isinstance(onnx, str):
        summary["onnx_min_cosine"] = min_cosine(onnx.encode(held, batch_size=32), reference)
    rows: list[dict] = []
    for config in args.cpu_configs:
        reason = _supported(config)
        if reason:
            summary["unavailable"][config] = reason
            print(f"[cpu] {config}: skipped ({reason})", flush=True)
            continue
        settings = {**server_settings(args), **CONFIGS[config]}
        started = time.monotonic()
        with running_servers(1, log_path(args, f"cpu-{config}"), **settings) as servers:
            ready_s = time.monotonic() - started
            url = servers[0][1]
            with httpx.Client(base_url=url, timeout=60) as client:
                info = client.get("/info").json()
                cosine = min_cosine(_served_vectors(client, held, info["model"]), reference)
                load(url, texts[:64], args.cpu_clients, 2, args.per_request, payload="openai")  # warm
                points, ratios = [], []
                for _ in range(args.rounds):
                    rates = {name: _encode_rate(peers[name], texts) for name in peer_rounds}
                    for name, rate in rates.items():
                        peer_rounds[name].append(rate)
                    points.append(_closed_loop(url, texts, args))
                    ratios.append(points[-1]["texts_per_s"] / rates["sentence-transformers"])
                one_text = _one_text_ms(lambda t: _served_vectors(client, [t], info["model"]), singles)
        middle = sorted(points, key=lambda p: p["texts_per_s"])[len(points) // 2]
        rows.append({"config": config, "dtype": info.get("dtype"), "cpu_isa": info.get("cpu_isa"),
                     "workers": info.get("worker", {}).get("workers"), "attention": info.get("attention"),
                     "ready_s": ready_s, "texts_per_s": middle["texts_per_s"],
                     "vs_sentence_transformers": statistics.median(ratios), "rounds": points,
                     "client_cpu_share": middle["client_cpu_s"] / middle["seconds"],
                     "one_text": one_text, "min_cosine": cosine,
                     "errors": sum(p["errors"] for p in points)})
        print(f"[cpu] {config}: {middle['texts_per_s']:.1f} texts/s, {statistics.median(ratios):.2f}x "
              f"sentence-transformers, one text p50 {one_text['p50_ms']:.1f} ms (sentence-transformers "
              f"{summary['sentence_transformers_one_text']['p50_ms']:.1f}), ready {ready_s:.1f} s, min cosine "
              f"{cosine:.6f}, client CPU {100 * rows[-1]['client_cpu_share']:.0f}%", flush=True)
        summary["peers"] = {name: {"texts_per_s": statistics.median(r), "rounds": r}
                            for name, r in peer_rounds.items()}
        save(rows, summary, False)
    save(rows, summary, True)
