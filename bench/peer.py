"""The serving suite's `peer` scenario: Infinity (infinity-emb 0.0.78, its torch engine) beside our server in the same
run, on the same model directory and the same texts, each sent the same OpenAI request (POST /v1/embeddings with
base64 vectors, as OpenAI's own client asks for them) by the same closed-loop load generator.

Infinity pins packages of its own (uvicorn < 0.33, typer, click, rich), so it runs from its own install folder
(bench/peer-wheels.sh fetches the wheels; --infinity-site names the folder), put first on its process's path only,
through bench/peer_launch.py (its CLI with a shim for transformers 5)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.harness import (SAME_MODEL_MIN_COSINE, free_port, kept_log, load, min_cosine, on_cuda, percentiles_ms,
                           request_body, running_servers, sentences, server_settings, traffic, wait_until_ready)

INFINITY_VERSION = "0.0.78"
PAYLOAD = "openai"  # harness.request_body: texts to /v1/embeddings, base64 vectors
REPO = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer-clients", type=int, nargs="+", default=[1, 64, 256],
                        help="peer: concurrent clients, one point per system each")
    parser.add_argument("--peer-batch-sizes", type=int, nargs="+", default=[32, 64, 128],
                        help="peer: Infinity's --batch-size values tried at --peer-sweep-clients; the best serves "
                             "every client count")
    parser.add_argument("--peer-sweep-clients", type=int, default=64, help="peer: clients of the batch-size sweep")
    parser.add_argument("--infinity-site", default=os.environ.get("PEER_INFINITY_SITE", "/tmp/infinity-site"),
                        help="peer: the folder Infinity's wheels are installed in (pip install --target; see "
                             "bench/peer-wheels.sh); default $PEER_INFINITY_SITE or /tmp/infinity-site")


def settings(args: argparse.Namespace) -> dict:
    return {"clients": args.peer_clients, "batch_sizes": args.peer_batch_sizes,
            "sweep_clients": args.peer_sweep_clients, "infinity_dtype": infinity_dtype(args),
            "route": request_body(PAYLOAD, [])[0], "body": request_body(PAYLOAD, ["..."])[1]}


def model_dir(args: argparse.Namespace) -> Path:
    from fusedserve.model.config import PRESETS
    from fusedserve.model.weights import default_model_dir

    if args.model in PRESETS:
        raise SystemExit("peer: Infinity loads a checkpoint directory; a preset (random init) has none")
    return default_model_dir() if args.model == "default" else Path(args.model).resolve()


def infinity_dtype(args: argparse.Namespace) -> str:
    """Our server's dtype when one is set; else what ours picks by default: on a GPU the model family's (float16;
    bfloat16 for the decoder embedders), float32 on the CPU."""
    from fusedserve.model.families import config_from_dir, family

    if args.dtype != "auto":
        return args.dtype
    if not on_cuda(args):
        return "float32"
    return str(family(config_from_dir(model_dir(args))).dtype_on_cuda).removeprefix("torch.")


def infinity_version(site: str) -> str:
    for dist in importlib.metadata.distributions(path=[site]):
        if dist.metadata["Name"].lower().replace("_", "-") == "infinity-emb":
            return dist.version
    raise SystemExit(f"peer: no infinity-emb in {site}: run bash bench/peer-wheels.sh, then install its wheels with "
                     "pip install --no-deps --target there")


@contextlib.contextmanager
def running_infinity(site: str, model: Path, *, device: str, dtype: str, batch_size: int, log_path: str,
                     ready_timeout_s: float = 600):
    """Infinity's server (`infinity_emb v2`, torch engine) on a free loopback port, `site` first on its path, offline
    and without usage statistics; its OpenAI route at /v1/embeddings (--url-prefix /v1) as ours. Yields (process,
    url) once GET /health answers (Infinity opens its port after loading and warming the model); stops it with
    SIGTERM, then SIGKILL after 30 s."""
    device_type, _, device_id = device.partition(":")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1",
               PYTHONPATH=os.pathsep.join(p for p in (site, str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("TRITON_INTERPRET", None)  # the harness's own switch on a CPU, as running_servers drops it for ours
    port = free_port()
    command = [sys.executable, "-m", "bench.peer_launch", "v2", "--model-id", str(model), "--engine", "torch",
               "--device", device_type, "--dtype", dtype, "--batch-size", str(batch_size), "--url-prefix", "/v1",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if device_id:
        command += ["--device-id", device_id]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "a") as log:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_until_ready(process, url + "/health", time.monotonic() + ready_timeout_s):
            tail = Path(log_path).read_text(errors="replace")[-3000:] if log_path != os.devnull else ""
            raise RuntimeError(f"Infinity did not become ready (exit code {process.poll()}); its log "
                               f"{log_path} ends:\n{tail}")
        yield process, url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def token_counts(model: Path, max_seq_length: int, texts: list[str]) -> list[int]:
    """Tokens each text runs as ([CLS] and [SEP] included, cut to the model's length), from the model's own
    tokenizer.json: what both servers' forwards see."""
    from fusedserve.model.tokenizer import TextTokenizer

    return list(map(len, TextTokenizer(model, max_seq_length).encode(texts)))


def embeddings(url: str, texts: list[str]) -> tuple[list[list[float]], dict]:
    r = httpx.post(url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=120)
    r.raise_for_status()
    body = r.json()
    return [item["embedding"] for item in sorted(body["data"], key=lambda item: item["index"])], body.get("usage", {})


def measure(args: argparse.Namespace, url: str, texts: list[str], tokens: list[int], clients: int, **labels) -> dict:
    run = load(url, texts, clients, args.seconds, args.per_request, tokens, args.client_processes, PAYLOAD)
    latencies, elapsed = run["latencies"], run["elapsed"]
    return {**labels, "clients": clients, "per_request": args.per_request, "requests": len(latencies),
            "errors": run["errors"], "seconds": elapsed, "texts_per_s": len(latencies) * args.per_request / elapsed,
            "tokens_per_s": run["tokens"] / elapsed, **percentiles_ms(latencies)}


def warm(args: argparse.Namespace, url: str, texts: list[str]) -> None:
    load(url, texts, 64, 3, args.per_request, processes=args.client_processes, payload=PAYLOAD)


def _table(rows: list[dict]) -> str:
    lines = [f"{'system':<11} {'phase':<6} {'batch':>5} {'clients':>7} {'texts/s':>9} {'tokens/s':>10} "
             f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>6}"]
    for r in rows:
        lines.append(f"{r['system']:<11} {r['phase']:<6} {r.get('batch_size') or '-':>5} {r['clients']:>7} "
                     f"{r['texts_per_s']:>9.1f} {r['tokens_per_s']:>10.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                     f"{r['errors']:>6}")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> dict:
    """Per client count, ours over Infinity's (at its best batch size): tokens/s (above 1: ours serves more), p50 and
    p99 (below 1: ours answers sooner), and whether ours is ahead on all three."""
    ours = {r["clients"]: r for r in rows if r["system"] == "fusedserve"}
    theirs = {r["clients"]: r for r in rows if r["system"] == "infinity" and r["phase"] == "serve"}
    out = {}
    for clients in sorted(ours.keys() & theirs.keys()):
        a, b = ours[clients], theirs[clients]
        ratio = {k: a[k] / b[k] if b[k] else None for k in ("tokens_per_s", "p50_ms", "p99_ms")}
        ratio["ours_ahead"] = bool(ratio["tokens_per_s"] and ratio["tokens_per_s"] > 1 and ratio["p50_ms"] < 1
                                   and ratio["p99_ms"] < 1)
        out[str(clients)] = ratio
    return out


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_scenario(args: argparse.Namespace, save) -> None:
    site = str(Path(args.infinity_site).resolve())
    model = model_dir(args)
    dtype = infinity_dtype(args)
    texts = traffic(args)
    # fixed 20-word sentences and a few of the traffic's texts, the longest among them: both servers must give the
    # same vectors for them, or the two would not be serving the same model
    check = sentences(4, 20) + sorted(texts, key=len)[-4:] + texts[:4]
    summary: dict = {"texts": len(texts), "model_dir": str(model), "per_request": args.per_request,
                     "infinity": {"version": infinity_version(site), "engine": "torch", "dtype": dtype, "site": site},
                     "libraries": {name: _version(name) for name in ("torch", "transformers", "sentence-transformers",
                                                                     "fastapi", "starlette", "uvicorn")},
                     "fusedserve": {"version": _version("fusedserve")}}
    rows: list[dict] = []

    def point(url: str, clients: int, **labels) -> None:
        rows.append(measure(args, url, texts, tokens, clients, **labels))
        r = rows[-1]
        print(f"[peer] {r['system']}{' batch ' + str(r['batch_size']) if r.get('batch_size') else ''}, "
              f"{clients} clients: {r['texts_per_s']:.1f} texts/s, {r['tokens_per_s']:.0f} tokens/s, p50 "
              f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, {r['errors']} errors", file=sys.stderr, flush=True)
        save(rows, summary, False)

    with running_servers(1, kept_log(args, "peer-fusedserve"), **server_settings(args)) as servers:
        url = servers[0][1]
        info = httpx.get(url + "/info", timeout=30).json()
        tokens = token_counts(model, info["max_seq_length"], texts)
        summary["tokens"] = sum(tokens)
        summary["fusedserve"].update(dtype=info.get("dtype"), info=info)
        ours_check, usage = embeddings(url, check)
        expected = summary["check_tokens"] = sum(token_counts(model, info["max_seq_length"], check))
        if usage.get("prompt_tokens") != expected:  # the tokens/s of both systems are counted with token_counts
            raise RuntimeError(f"our server ran {usage.get('prompt_tokens')} tokens for the check texts, the "
                               f"tokenizer counts {expected}")
        warm(args, url, texts)
        for clients in args.peer_clients:
            point(url, clients, system="fusedserve", phase="serve", batch_size=None)

    def infinity(batch_size: int):
        return running_infinity(site, model, device=args.device, dtype=dtype, batch_size=batch_size,
                                log_path=kept_log(args, f"peer-infinity-{batch_size}"))

    for batch_size in args.peer_batch_sizes:
        with infinity(batch_size) as (_, url):
            if "same_model_min_cosine" not in summary:
                theirs, their_usage = embeddings(url, check)
                cosine = min_cosine(ours_check, theirs)
                summary["same_model_min_cosine"] = cosine
                summary["infinity"]["check_usage"] = their_usage
                print(f"[peer] Infinity vs ours on {len(check)} texts: lowest cosine {cosine:.6f}", file=sys.stderr,
                      flush=True)
                if not cosine > SAME_MODEL_MIN_COSINE:
                    raise RuntimeError(f"Infinity's embeddings differ from ours (lowest cosine {cosine:.6f}): the "
                                       f"two do not serve the same model from {model}")
            warm(args, url, texts)
            point(url, args.peer_sweep_clients, system="infinity", phase="sweep", batch_size=batch_size)
    sweep = [r for r in rows if r["phase"] == "sweep"]
    best = max(sweep, key=lambda r: r["tokens_per_s"])["batch_size"]
    summary["infinity"]["best_batch_size"] = best
    with infinity(best) as (_, url):
        warm(args, url, texts)
        for clients in args.peer_clients:
            point(url, clients, system="infinity", phase="serve", batch_size=best)
    summary["ours_over_infinity"] = ratios(rows)
    print(_table(rows), file=sys.stderr, flush=True)
    for clients, r in summary["ours_over_infinity"].items():
        print(f"{clients} clients: ours/Infinity tokens/s x{r['tokens_per_s']:.2f}, p50 x{r['p50_ms']:.2f}, p99 "
              f"x{r['p99_ms']:.2f} ({'ours ahead' if r['ours_ahead'] else 'ours NOT ahead on all three'})",
              file=sys.stderr, flush=True)
    save(rows, summary, True)
