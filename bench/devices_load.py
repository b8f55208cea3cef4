"""The serving suite's `devices` scenario: one server on every visible GPU against the same server pinned to one GPU
and half of the host's CPUs (so that host capacity scales with the GPUs), both with WORKERS=auto, driven by
openai-load's clients (separate load-generator processes, `/v1/embeddings`); then a fault case.

- Points (--devices-points, CLIENTSxTEXTS): --model with float JSON vectors (host-bound); with --devices-big-model
  (a GPU-bound model, BERT-base-shaped), that model at --devices-big-point with base64 vectors, a server of its own.
  Each point reports requests/s, tokens/s, p50/p99, the load generator's and the server's CPU, and per device its
  busy share (fusedserve_device_busy_seconds_total over the point's seconds, summed over the device's workers: it
  can pass 1 when several workers overlap) and tokens/s share. The summary holds every GPU's tokens/s over one
  GPU's per point, the big model's against --min-scaling.
- The fault case (--fault-point, --fault-seconds, on every GPU, --model): the corpus's vectors are taken first, one
  request per text; then load, and once --fault-after seconds have passed, every worker of the last device is
  killed (SIGKILL; the workers found through /info over fresh connections). Reported: requests answered and failed
  (a connection reset or a non-200), answers that differ from the text's vector (cosine below
  SAME_ANSWER_MIN_COSINE; must be 0), and the rejoin time: from the kill until each replacement worker has answered
  /info (a replacement listens only once its models are ready, so answering is serving).

Fake devices make the whole scenario runnable on a CPU (tests/bench/test_devices_load.py): LAUNCH is the server
command, which the test points at the test server module with its fake-GPU hook.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import sys
import time

import httpx
import numpy as np

from bench.harness import (CURRENT, ClientProcesses, client_shares, extra_settings, log_path, one_connection_session,
                           running_servers, traffic)
from bench.openai_load import ROUTE, point, point_name, point_row, run_point

LAUNCH = CURRENT
# the same text's vector from two devices of one server (the same kernels, the same weights): anything lower is
# another request's answer or a broken device
SAME_ANSWER_MIN_COSINE = 0.999


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices-points", type=point, nargs="+", default=[(64, 1), (256, 1), (64, 16)],
                        metavar="CLIENTSxTEXTS", help="devices: --model's points (float JSON)")
    parser.add_argument("--devices-big-model", metavar="DIR",
                        help="devices: a GPU-bound model (BERT-base-shaped) run at --devices-big-point, base64")
    parser.add_argument("--devices-big-point", type=point, default=(256, 16), metavar="CLIENTSxTEXTS")
    parser.add_argument("--min-scaling", type=float, default=1.9,
                        help="devices: every GPU's tokens/s over one GPU's that the big model must reach")
    parser.add_argument("--fault-point", type=point, default=(64, 16), metavar="CLIENTSxTEXTS",
                        help="devices: the load during the fault case")
    parser.add_argument("--fault-seconds", type=float, default=45.0, help="devices: the fault case's load")
    parser.add_argument("--fault-after", type=float, default=5.0, help="devices: seconds of load before the kill")


def settings(args: argparse.Namespace) -> dict:
    return {"points": [point_name(*p) for p in args.devices_points], "big_model": args.devices_big_model,
            "big_point": point_name(*args.devices_big_point), "min_scaling": args.min_scaling,
            "fault": {"point": point_name(*args.fault_point), "seconds": args.fault_seconds,
                      "after": args.fault_after}, "server": {"model": args.model, "workers": "auto",
                                                            **extra_settings(args)}}


def _get(url: str, tries: int = 50) -> httpx.Response:
    """GET over a fresh connection, again after a reset: while a device's workers are being killed, a connection
    can land on a socket that is going away."""
    for _ in range(tries - 1):
        try:
            return httpx.get(url, timeout=30, headers={"Connection": "close"})
        except httpx.TransportError:
            time.sleep(0.05)
    return httpx.get(url, timeout=30, headers={"Connection": "close"})


# what the scenario reads of the server's metrics per device: key -> sample name
DEVICE_SAMPLES = {"busy": "fusedserve_device_busy_seconds_total", "tokens": "fusedserve_device_tokens_total",
                  "workers": "fusedserve_device_workers"}


def device_sums(url: str) -> dict[str, dict[str, float]]:
    """key of DEVICE_SAMPLES -> device -> value, summed over the other labels, from one read of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {name: key for key, name in DEVICE_SAMPLES.items()}
    out: dict[str, collections.Counter] = {key: collections.Counter() for key in DEVICE_SAMPLES}
    for family in text_string_to_metric_families(_get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name in names and "device" in sample.labels:
                out[names[sample.name]][sample.labels["device"]] += sample.value
    return {key: dict(values) for key, values in out.items()}


def workers_by_device(url: str, tries: int = 400) -> dict[str, set[int]]:
    """device -> the worker pids seen answering /info, each over a fresh connection (the kernel spreads new
    connections over the workers' sockets), until as many as fusedserve_device_workers counts are seen."""
    expected = {d: round(n) for d, n in device_sums(url)["workers"].items()}
    seen: dict[str, set[int]] = collections.defaultdict(set)
    for _ in range(tries):
        worker = _get(url + "/info").json()["worker"]
        seen[worker["device"]].add(worker["pid"])
        if all(len(seen[d]) >= n for d, n in expected.items()):
            break
    return dict(seen)


def measured_point(pool: ClientProcesses, url: str, texts: list[str], clients: int, per_request: int, seconds: float,
                   warm_seconds: float, encoding: str, **labels) -> dict:
    """One point (after its warm-up) with each device's busy share and tokens/s share over it."""
    if warm_seconds > 0:
        run_point(pool, url, texts, clients, per_request, warm_seconds, encoding=encoding)
    before = device_sums(url)
    run = run_point(pool, url, texts, clients, per_request, seconds, metrics_url=url, encoding=encoding)
    after = device_sums(url)
    row = point_row(run, clients, per_request, **labels)
    tokens = {d: v - before["tokens"].get(d, 0.0) for d, v in after["tokens"].items()}
    total = sum(tokens.values())
    row["devices"] = {d: {"busy": (v - before["busy"].get(d, 0.0)) / run["elapsed"],
                          "tokens_share": tokens.get(d, 0.0) / total if total else None}
                      for d, v in after["busy"].items()}
    return row


async def checking_clients(url: str, texts: list[str], clients: int, seconds: float, per_request: int, seed: int,
                           vectors: np.ndarray) -> dict:
    """openai-load's clients, keeping each answer's time and checking every vector against its text's own
    (`vectors`, unit rows): a wrong answer is one below SAME_ANSWER_MIN_COSINE."""
    import aiohttp

    answered: list[float] = []
    failed: list[float] = []
    wrong = 0
    rng = random.Random(seed)
    stop = time.monotonic() + seconds

    async def client_loop() -> None:
        nonlocal wrong
        async with one_connection_session(url) as session:
            while time.monotonic() < stop:
                picked = [rng.randrange(len(texts)) for _ in range(per_request)]
                try:
                    async with session.post(ROUTE, json={"input": [texts[i] for i in picked],
                                                         "encoding_format": "float"}) as response:
                        status, payload = response.status, await response.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    failed.append(time.time())
                    await asyncio.sleep(0.05)
                    continue
                if status != 200:
                    failed.append(time.time())
                    continue
                got = np.array([item["embedding"] for item in sorted(payload["data"], key=lambda x: x["index"])])
                wrong += int(((got * vectors[picked]).sum(axis=1) < SAME_ANSWER_MIN_COSINE).sum())
                answered.append(time.time())

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return {"answered": answered, "failed": failed, "wrong": wrong}


def fault_case(args: argparse.Namespace, pool: ClientProcesses, url: str, texts: list[str]) -> dict:
    """Load on every device; past --fault-after seconds every worker of the last device killed."""
    corpus = texts[:256]
    vectors = np.array([httpx.post(url + ROUTE, json={"input": [t]}, timeout=60).json()["data"][0]["embedding"]
                        for t in corpus])
    before = workers_by_device(url)
    victim = sorted(before)[-1]
    clients, per_request = args.fault_point
    jobs = [(url, corpus, n, args.fault_seconds, per_request, 1 + i, vectors)
            for i, n in enumerate(client_shares(clients, len(pool)))]
    started = time.time()
    pool.submit(checking_clients, jobs)
    time.sleep(args.fault_after)
    killed_at = time.time()
    for pid in before[victim]:
        os.kill(pid, signal.SIGKILL)
    rejoined_at = None
    while time.time() - killed_at < args.fault_seconds:
        now = workers_by_device(url, tries=40)
        if len(now.get(victim, set()) - before[victim]) >= len(before[victim]):
            rejoined_at = time.time()
            break
        time.sleep(0.2)
    parts = pool.collect(args.fault_seconds + 300)
    answered = [t for p in parts for t in p["answered"]]
    failed = [t for p in parts for t in p["failed"]]
    after = workers_by_device(url)
    return {"device": victim, "killed_workers": len(before[victim]), "workers_before": _counts(before),
            "workers_after": _counts(after), "seconds": time.time() - started,
            "answered": len(answered), "failed": len(failed), "wrong": sum(p["wrong"] for p in parts),
            "failed_after_kill_s": [round(t - killed_at, 3) for t in failed],
            "answered_while_out": sum(killed_at <= t < (rejoined_at or float("inf")) for t in answered),
            "rejoin_s": None if rejoined_at is None else rejoined_at - killed_at}


def _counts(seen: dict[str, set[int]]) -> dict[str, int]:
    return {d: len(pids) for d, pids in sorted(seen.items())}


def half_of_the_cpus() -> frozenset[int]:
    cpus = sorted(os.sched_getaffinity(0))
    return frozenset(cpus[: max(1, len(cpus) // 2)])


def devices_scenario(args: argparse.Namespace, save) -> None:
    texts = traffic(args, low=5)
    gpus = _visible_gpus()
    configs = {"every GPU": ({}, None), "one GPU": ({"device": gpus[0]}, half_of_the_cpus())}
    models = [(args.model, args.devices_points, "float")]
    if args.devices_big_model:
        models.append((args.devices_big_model, [args.devices_big_point], "base64"))
    rows: list[dict] = []
    summary: dict = {"gpus": gpus, "texts": len(texts)}
    with ClientProcesses(max(1, args.client_processes)) as pool:
        for config, (placement, cpus) in configs.items():
            for model, points, encoding in models:
                name = f"devices-{config.replace(' ', '-').lower()}-{os.path.basename(model.rstrip('/'))}"
                with running_servers(1, log_path(args, name), launch=LAUNCH, cpus=cpus, model=model,
                                     workers="auto", **placement, **extra_settings(args)) as servers:
                    url = servers[0][1]
                    workers = _counts(workers_by_device(url))
                    for clients, per_request in points:
                        row = measured_point(pool, url, texts, clients, per_request, args.seconds,
                                             args.warm_seconds, encoding, config=config, model=model,
                                             vectors=encoding, workers=workers,
                                             server_cpus=len(cpus) if cpus else len(os.sched_getaffinity(0)))
                        rows.append(row)
                        _say(row)
                        save(rows, summary, False)
                    if config == "every GPU" and model == args.model:
                        summary["fault"] = fault_case(args, pool, url, texts)
                        print(f"[devices] fault case: {summary['fault']}", file=sys.stderr, flush=True)
                        save(rows, summary, False)
    summary["scaling"] = scaling(rows, args.devices_big_model, args.min_scaling)
    save(rows, summary, True)


def scaling(rows: list[dict], big_model: str | None, min_scaling: float) -> dict:
    """Per model and point: every GPU's tokens/s over one GPU's; the big model's must reach min_scaling with each
    device busy."""
    out = {}
    for row in rows:
        if row["config"] != "every GPU":
            continue
        one = next((r for r in rows if r["config"] == "one GPU" and r["model"] == row["model"]
                    and r["point"] == row["point"]), None)
        if one is None or not one["tokens_per_s"]:
            continue
        entry = {"ratio": row["tokens_per_s"] / one["tokens_per_s"],
                 "busy": {d: v["busy"] for d, v in row["devices"].items()}}
        if row["model"] == big_model:
            entry["met"] = entry["ratio"] >= min_scaling and all(b > 0 for b in entry["busy"].values())
        out[f"{os.path.basename(row['model'].rstrip('/'))} {row['point']}"] = entry
    return out


def _visible_gpus() -> list[str]:
    from fusedserve.server.devices import visible_gpus

    gpus = os.environ.get("TEST_FAKE_GPUS", "") or ",".join(visible_gpus())
    names = [g for g in gpus.split(",") if g]
    if len(names) < 2:
        raise SystemExit(f"devices: needs two GPUs or more; this machine has {names or 'none'}")
    return names


def _say(row: dict) -> None:
    busy = ", ".join(f"{d} busy {v['busy']:.2f}" for d, v in row["devices"].items())
    print(f"[devices] {row['config']}, {os.path.basename(row['model'].rstrip('/'))} {row['point']}: "
          f"{row['requests_per_s']:.0f} requests/s, {row['tokens_per_s']:.0f} tokens/s, p50 {row['p50_ms']:.1f} ms; "
          f"{busy}", file=sys.stderr, flush=True)

