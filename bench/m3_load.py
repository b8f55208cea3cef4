"""The serving suite's `m3` scenario: a BGE-M3-shaped directory served (XLM-RoBERTa-large's shape, random weights; or
--m3-model's), POST /v1/embeddings from aiohttp clients in load-generator processes in four request shapes, to put
the price of BGE-M3's three outputs beside its dense one.

The shapes (SHAPES: one client iteration each, float JSON): `dense` ({"input": texts}), `all-in-one` (the three
outputs of one forward: output ["dense", "multi_vector", "sparse"]), `three-requests` (output "dense", then
"multi_vector", then "sparse", one after another) and `sparse` (output "sparse"). At each point (--m3-points,
CLIENTSxTEXTS) the shapes take turns, in an order reversed every round (--m3-rounds), each after --warm-seconds of its
own load: requests/s, texts/s (texts given every output of the shape), tokens/s (their usage.prompt_tokens, once a
text), p50/p99 of an iteration (three-requests': the three together), response bytes per request and per text, and
the CPU of the load generator and of the server. The summary holds each shape's medians over the rounds and the
tokens/s ratios: all-in-one over dense (what the two other outputs cost) and all-in-one over three-requests (what one
forward saves).

Before any load, a few texts in each shape must come back alike (float-equal, or within SAME_FORWARD_MIN_COSINE):
all-in-one's dense beside the dense requests', its multi-vectors and sparse weights beside their own requests', so the
rates compare like with like.

Unless --m3-model names one, the directory is tests/model/checkpoints.bge_m3 at --m3-shape, built once into --m3-cache
by a Python process started outside the tree's root, as bench/gpu.sh builds its checkpoints (with the root on the path,
transformers' probe for Hugging Face's `kernels` package finds our kernels/ folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.harness import (ClientProcesses, client_shares, extra_settings, log_path, merge_runs, one_connection_session,
                           percentiles_ms, running_servers, sentences, server_sums, settled_sums, traffic)
from bench.openai_load import ROUTE, point, point_name

M3_OUTPUTS = ["dense", "multi_vector", "sparse"]
# shape -> the `output` of each request of one client iteration, in order (None: no `output` field)
SHAPES: dict[str, tuple] = {"dense": (None,), "all-in-one": (M3_OUTPUTS,), "three-requests": tuple(M3_OUTPUTS),
                            "sparse": ("sparse",)}
# one forward's outputs, served through two routes' code: the same numbers, but for a reduction order at most
SAME_FORWARD_MIN_COSINE = 1 - 1e-5
METRICS = ("requests_per_s", "texts_per_s", "tokens_per_s", "tokens_per_text", "p50_ms", "p99_ms",
           "response_bytes_per_request", "response_bytes_per_text", "client_cpu_share", "server_cpu_cores")
# the shapes of tests/model/checkpoints.bge_m3 (tiny: CPU tests; large: BAAI/bge-m3's)
MODEL_SHAPES = ("tiny", "large")
CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m3-model", metavar="DIR",
                        help="m3: the BGE-M3 directory served (default: a random one of --m3-shape, built once "
                             "into --m3-cache)")
    parser.add_argument("--m3-shape", choices=MODEL_SHAPES, default="large",
                        help="m3: the built directory's shape (large: XLM-RoBERTa-large's, as BAAI/bge-m3)")
    parser.add_argument("--m3-cache", metavar="DIR",
                        help="m3: where the built directory is kept between runs (default: the system's temporary "
                             "directory)")
    parser.add_argument("--m3-points", type=point, nargs="+", default=[(64, 16)], metavar="CLIENTSxTEXTS",
                        help="m3: clients x texts a request, one point each (every shape at each)")
    parser.add_argument("--m3-rounds", type=int, default=2,
                        help="m3: each point's shapes this many times, in an order reversed every round")


def model_dir(args: argparse.Namespace) -> Path:
    if args.m3_model:
        return Path(args.m3_model)
    return Path(args.m3_cache or tempfile.gettempdir()) / f"fusedserve-bench-bge-m3-{args.m3_shape}"


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The project's defaults but for the model (the BGE-M3 directory), device and dtype, plus any --setting."""
    return {"model": str(model_dir(args)), "device": args.device, "dtype": args.dtype, **extra_settings(args)}


def settings(args: argparse.Namespace) -> dict:
    """What the results block records as this scenario's settings."""
    return {"model_shape": None if args.m3_model else args.m3_shape,
            "points": [point_name(*p) for p in args.m3_points], "rounds": args.m3_rounds,
            "shapes": {name: list(outputs) for name, outputs in SHAPES.items()}, "route": ROUTE,
            "encoding_format": "float", "warm_seconds": args.warm_seconds, "server": server_settings(args),
            "corpus_words": [min(5, args.max_words), args.max_words]}


# ---- the model --------------------------------------------------------------------------------------------------
def build(path: Path, shape: str) -> float:
    """tests/model/checkpoints.bge_m3(path, shape=shape) in a Python process of its own, started outside the tree's
    root and without it on the path; built beside `path` and renamed into place, so a directory there is whole.
    Returns the seconds it took."""
    root = Path(__file__).resolve().parents[1]
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    code = ("import sys; from pathlib import Path; sys.path.append(sys.argv[1]); import checkpoints; "
            "checkpoints.bge_m3(Path(sys.argv[2]), shape=sys.argv[3])")
    path_entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(path_entries)}
    print(f"[m3] building a {shape} BGE-M3 directory in {path}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(root / "tests" / "model"), str(partial), shape],
                          cwd=path.parent, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"building the {shape} BGE-M3 directory failed ({done.returncode}):\n{done.stderr[-3000:]}")
    partial.rename(path)
    return time.perf_counter() - started


def _safetensors_dtypes(path: Path) -> list[str]:
    """The tensor types a safetensors file holds, from its header."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sorted({entry["dtype"] for name, entry in header.items() if name != "__metadata__"})


def prepare_model(args: argparse.Namespace) -> dict:
    """The directory to serve, built first where it is ours and not there yet: what the summary says of it."""
    path = model_dir(args)
    built_seconds = None
    if not args.m3_model and not path.is_dir():
        built_seconds = build(path, args.m3_shape)
    if not (path / "config.json").is_file() or not (path / "colbert_linear.pt").is_file():
        raise SystemExit(f"{path}: not a BGE-M3 directory (config.json and colbert_linear.pt beside the weights)")
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("*.safetensors"))
    return {"dir": str(path), "shape": None if args.m3_model else args.m3_shape, "built_seconds": built_seconds,
            "config": {k: config.get(k) for k in CONFIG_KEYS},
            "weights_bytes": sum(w.stat().st_size for w in weights),
            "weights_dtypes": sorted({d for w in weights for d in _safetensors_dtypes(w)})}


# ---- the same forward through every shape -----------------------------------------------------------------------
def _items(url: str, texts: list[str], output) -> list[dict]:
    body = {"input": texts} if output is None else {"input": texts, "output": output}
    r = httpx.post(url + ROUTE, json=body, timeout=300)
    r.raise_for_status()
    return sorted(r.json()["data"], key=lambda item: item["index"])


def _sparse_pair(a: list[dict], b: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Two inputs' sparse entries as two rows over the ids either holds."""
    x, y = {e["index"]: e["value"] for e in a}, {e["index"]: e["value"] for e in b}
    ids = sorted(x.keys() | y.keys())
    return np.array([[x.get(i, 0.0) for i in ids]]), np.array([[y.get(i, 0.0) for i in ids]])


def _cosines(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row i of x against row i of y ([rows, dim] each): 1 for two zero rows, 0 for one."""
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    both = nx * ny
    return np.where(both > 0, (x * y).sum(axis=1) / np.where(both > 0, both, 1), (nx == ny).astype(np.float64))


def compare(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    """got[i] against want[i] (each [rows, dim]: one input's vectors): float-equal, the lowest cosine of a row with
    its counterpart and the largest element difference; `same` when float-equal or that cosine is within
    SAME_FORWARD_MIN_COSINE. A row count that differs fails."""
    pairs = list(zip(got, want, strict=True))
    if any(g.shape != w.shape for g, w in pairs):
        return {"float_equal": False, "min_cosine": None, "max_abs_diff": None, "same": False,
                "shapes": [[list(g.shape), list(w.shape)] for g, w in pairs if g.shape != w.shape]}
    cosines = np.concatenate([_cosines(g, w) for g, w in pairs])
    equal = all(np.array_equal(g, w) for g, w in pairs)
    low = float(cosines.min())
    return {"float_equal": equal, "min_cosine": low,
            "max_abs_diff": max((float(np.abs(g - w).max()) for g, w in pairs if g.size), default=0.0),
            "same": equal or low >= SAME_FORWARD_MIN_COSINE}


def _dense(items: list[dict], key: str = "embedding") -> list[np.ndarray]:
    return [np.asarray([item[key]], np.float64) for item in items]


def _multi_vectors(items: list[dict], key: str) -> list[np.ndarray]:
    return [np.asarray(item[key], np.float64) for item in items]


def same_forward(url: str, texts: list[str]) -> dict:
    """`texts` in each shape: all-in-one's dense against the dense-only request's and three-requests' dense, its
    multi-vectors and sparse weights against their own requests'. `same`: every comparison within bounds."""
    dense_only = _items(url, texts, None)
    together = _items(url, texts, M3_OUTPUTS)
    apart = {output: _items(url, texts, output) for output in M3_OUTPUTS}
    sparse = [_sparse_pair(t["sparse_embedding"], a["embedding"]) for t, a in zip(together, apart["sparse"])]
    out = {"texts": len(texts),
           "dense_vs_dense_only": compare(_dense(together), _dense(dense_only)),
           "dense_vs_three_requests": compare(_dense(together), _dense(apart["dense"])),
           "multi_vector_vs_three_requests": compare(_multi_vectors(together, "multi_vector"),
                                                     _multi_vectors(apart["multi_vector"], "embedding")),
           "sparse_vs_three_requests": compare([x for x, _ in sparse], [y for _, y in sparse])}
    out["same"] = all(v["same"] for v in out.values() if isinstance(v, dict))
    return out


# ---- load -------------------------------------------------------------------------------------------------------
def _prompt_tokens(status: int, payload: bytes, per_request: int) -> int | None:
    """The usage.prompt_tokens of a 200 answer holding one item per text, else None. Read without parsing the body:
    a multi-vector answer is megabytes of float text, and parsing it in full would make the load generator the bound.
    The server writes compact JSON (orjson) with `usage` last."""
    if status != 200 or payload.count(b'"object":"embedding"') != per_request:
        return None
    try:
        return int(json.loads(b"{" + payload[payload.rfind(b'"usage":'):])["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


async def m3_clients(url: str, texts: list[str], clients: int, seconds: float, per_request: int, seed: int,
                     shape: str) -> dict:
    """`clients` aiohttp sessions of one connection each, each running its next iteration of `shape` (SHAPES: one
    request, or three one after another, of `per_request` texts picked at random) when the last is done, for
    `seconds`. An iteration counts when every request of it is answered 200 with one item per text; its texts' tokens
    (the first answer's usage: the others' is the same) add to the tokens. Runs in a load-generator process."""
    import aiohttp

    outputs = SHAPES[shape]
    latencies: list[float] = []
    errors = tokens = requests = received = 0
    rng = random.Random(seed)
    stop = time.monotonic() + seconds

    async def client_loop() -> None:
        nonlocal errors, tokens, requests, received
        async with one_connection_session(url) as session:
            while time.monotonic() < stop:
                picked = [texts[rng.randrange(len(texts))] for _ in range(per_request)]
                answered: list[tuple[int, int]] = []  # (prompt tokens, response bytes) per request
                t = time.perf_counter()
                for output in outputs:
                    body = {"input": picked} if output is None else {"input": picked, "output": output}
                    try:
                        async with session.post(ROUTE, json=body) as response:
                            status, payload = response.status, await response.read()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # counted, and the run goes on
                        print(f"client error: {type(exc).__name__}: {exc}", file=sys.stderr)
                        await asyncio.sleep(0.1)  # back off a server that refuses connections
                        break
                    used = _prompt_tokens(status, payload, per_request)
                    if used is None:
                        break
                    answered.append((used, len(payload)))
                elapsed = time.perf_counter() - t
                if len(answered) < len(outputs):
                    errors += 1
                    continue
                latencies.append(elapsed)
                tokens += answered[0][0]
                requests += len(answered)
                received += sum(size for _, size in answered)

    started, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": time.monotonic() - started, "tokens": tokens,
            "requests": requests, "bytes": received, "cpu": time.process_time() - cpu}


def run_shape(pool: ClientProcesses, url: str, texts: list[str], clients: int, per_request: int, seconds: float,
              shape: str) -> dict:
    """One closed-loop run of `shape` from `clients` over the pool's processes, all started together, with the
    server's CPU seconds over it (its /metrics before and after)."""
    jobs = [(url, texts, n, seconds, per_request, 1 + i, shape)
            for i, n in enumerate(client_shares(clients, len(pool)))]
    before = server_sums(url, ROUTE)
    parts = pool.run(m3_clients, jobs, timeout_s=seconds + 300)
    run = merge_runs(parts)
    run.update(requests=sum(p["requests"] for p in parts), bytes=sum(p["bytes"] for p in parts),
               server_cpu=settled_sums(url, ROUTE)["cpu"] - before["cpu"])
    return run


def shape_row(run: dict, shape: str, clients: int, per_request: int, **labels) -> dict:
    """A shape's numbers at one point. requests: HTTP requests answered (three an iteration for three-requests);
    texts and tokens: those given every output of the shape, each once."""
    latencies, elapsed, cores = run["latencies"], run["elapsed"], os.cpu_count() or 1
    texts = len(latencies) * per_request
    return {**labels, "point": point_name(clients, per_request), "shape": shape, "clients": clients,
            "per_request": per_request, "requests_per_iteration": len(SHAPES[shape]), "iterations": len(latencies),
            "requests": run["requests"], "errors": run["errors"], "seconds": elapsed,
            "requests_per_s": run["requests"] / elapsed, "texts_per_s": texts / elapsed,
            "tokens_per_s": run["tokens"] / elapsed, "tokens_per_text": run["tokens"] / max(texts, 1),
            **percentiles_ms(latencies),
            "response_bytes_per_request": run["bytes"] / max(run["requests"], 1),
            "response_bytes_per_text": run["bytes"] / max(texts, 1),
            "client_cpu_cores": run["cpu"] / elapsed, "client_cpu_share": run["cpu"] / elapsed / cores,
            "server_cpu_cores": run["server_cpu"] / elapsed, "server_cpu_share": run["server_cpu"] / elapsed / cores,
            "server_cpu_ms_per_text": 1e3 * run["server_cpu"] / max(texts, 1)}


def shape_order(round_: int) -> list[str]:
    """The shapes of one round: SHAPES' order, reversed every other round (a drift through the run falls on all)."""
    names = list(SHAPES)
    return names if round_ % 2 == 0 else names[::-1]


def medians(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """point -> shape -> each metric's median over the rounds (and how many rounds, and their errors in all)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        grouped.setdefault(row["point"], {}).setdefault(row["shape"], []).append(row)
    return {name: {shape: {"rounds": len(runs), "errors": sum(r["errors"] for r in runs),
                           **{m: statistics.median(r[m] for r in runs) for m in METRICS}}
                   for shape, runs in shapes.items()}
            for name, shapes in grouped.items()}


def ratios(per_point: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """Per point, tokens/s over tokens/s: all-in-one over dense (the two more outputs' price), all-in-one over
    three-requests (one forward's saving over three) and sparse over dense."""
    def over(shapes: dict, a: str, b: str) -> float | None:
        if a not in shapes or b not in shapes or not shapes[b]["tokens_per_s"]:
            return None
        return shapes[a]["tokens_per_s"] / shapes[b]["tokens_per_s"]

    return {name: {"all_in_one_over_dense_tokens_per_s": over(shapes, "all-in-one", "dense"),
                   "one_forward_over_three_requests_tokens_per_s": over(shapes, "all-in-one", "three-requests"),
                   "sparse_over_dense_tokens_per_s": over(shapes, "sparse", "dense")}
            for name, shapes in per_point.items()}


def _say(row: dict) -> None:
    print(f"[m3] round {row['round'] + 1}, {row['point']}, {row['shape']}: {row['requests_per_s']:.1f} requests/s, "
          f"{row['texts_per_s']:.0f} texts/s, {row['tokens_per_s']:.0f} tokens/s, p50 {row['p50_ms']:.1f} ms, p99 "
          f"{row['p99_ms']:.1f} ms, {row['response_bytes_per_request'] / 1e3:.0f} kB a response, {row['errors']} "
          f"errors; load generator {row['client_cpu_share']:.0%} of the CPUs, server {row['server_cpu_cores']:.2f} "
          "cores", file=sys.stderr, flush=True)


def table(per_point: dict[str, dict[str, dict]], ratios_: dict[str, dict]) -> str:
    lines = [f"{'point':>6} {'shape':<15} {'requests/s':>10} {'texts/s':>9} {'tokens/s':>10} {'p50 ms':>8} "
             f"{'p99 ms':>8} {'kB/request':>10} {'client CPU':>10} {'server cores':>12}"]
    for name, shapes in per_point.items():
        for shape, m in shapes.items():
            lines.append(f"{name:>6} {shape:<15} {m['requests_per_s']:>10.1f} {m['texts_per_s']:>9.1f} "
                         f"{m['tokens_per_s']:>10.0f} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f} "
                         f"{m['response_bytes_per_request'] / 1e3:>10.1f} {m['client_cpu_share']:>10.0%} "
                         f"{m['server_cpu_cores']:>12.2f}")
    for name, r in ratios_.items():
        lines.append(f"{name}: tokens/s " + ", ".join(
            f"{label} {'-' if r[key] is None else f'x{r[key]:.3f}'}" for label, key in (
                ("all-in-one / dense", "all_in_one_over_dense_tokens_per_s"),
                ("all-in-one / three requests", "one_forward_over_three_requests_tokens_per_s"),
                ("sparse / dense", "sparse_over_dense_tokens_per_s"))))
    return "\n".join(lines)


def m3_scenario(args: argparse.Namespace, save) -> None:
    texts = traffic(args, low=5)
    summary: dict = {"texts": len(texts), "client_processes": args.client_processes, "model": prepare_model(args)}
    rows: list[dict] = []
    with ClientProcesses(max(1, args.client_processes)) as pool, \
            running_servers(1, log_path(args, "m3"), **server_settings(args)) as servers:
        url = servers[0][1]
        summary["info"] = httpx.get(url + "/info", timeout=30).json()
        # the corpus's shortest and longest texts among a few: one forward's outputs, whichever shape asked
        summary["same_forward"] = check = same_forward(url, sentences(2, 5) + sorted(texts, key=len)[-2:])
        save(rows, summary, False)
        if not check["same"]:
            raise RuntimeError(f"the shapes' outputs differ for the same texts: {check}")
        for clients, per_request in args.m3_points:
            for round_ in range(args.m3_rounds):
                for shape in shape_order(round_):
                    if args.warm_seconds > 0:
                        run_shape(pool, url, texts, clients, per_request, args.warm_seconds, shape)
                    run = run_shape(pool, url, texts, clients, per_request, args.seconds, shape)
                    rows.append(shape_row(run, shape, clients, per_request, round=round_))
                    _say(rows[-1])
                    save(rows, summary, False)
    summary["medians"] = medians(rows)
    summary["ratios"] = ratios(summary["medians"])
    print(table(summary["medians"], summary["ratios"]), file=sys.stderr, flush=True)
    save(rows, summary, True)
