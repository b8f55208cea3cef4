"""Where a single request's latency goes without a GPU: the real server (FastAPI, uvicorn, tokenizer, batcher, worker
thread) with the model's forward replaced by a sleep of a graph replay's length, measured from httpx and from the
standard library's http.client (whose own cost per request is far smaller), next to GET /healthz round trips.

    python -m bench.single_latency --forward-ms 0.25 --out bench/results/$(date +%F)-cpu-single-latency.json

The forward stand-in returns ones (the batcher's delivery, normalization and JSON run as usual). This measures the
serving stack, not the model: on the H200 `python -m bench.serve --device cuda --single-only` measures the real one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench import command, save
from bench.serve import running_servers, sentences, single_requests


def _serve(forward_s: float, argv: list[str]) -> None:
    """The server with Embedder.launch_ids replaced by a sleep (run in the child process)."""
    import torch

    import model.runner as runner
    from server.__main__ import main

    def launch_ids(self, batch, *, graphs=True):
        time.sleep(forward_s)
        return runner.Pending(torch.ones(len(batch), self.config.hidden_size))

    runner.Embedder.launch_ids = launch_ids
    sys.exit(main(argv))


def measure(forward_ms: float, count: int) -> dict:
    """bench.serve's single-request split (httpx, the server's own account, http.client) against the stub server."""
    command = [sys.executable, "-m", "bench.single_latency", "--serve", str(forward_ms / 1e3)]
    with running_servers(1, command=command, device="cpu", kernel_timing_sample_rate="0", verify_sample_rate="0",
                         drain_delay_s="0") as servers:
        single = single_requests(servers[0][1], sentences(1, 20), count)
    return {"forward_ms": forward_ms, "requests": count, "server": single["server"],
            "httpx": {"infer_p50_ms": single["p50_ms"], "infer_p99_ms": single["p99_ms"],
                      "healthz_p50_ms": single["healthz_p50_ms"]},
            "http_client": single["raw_client"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # the child: the server itself
        _serve(float(argv[1]), argv[2:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.single_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-ms", type=float, default=0.25, help="the forward's stand-in (default: a b1 replay)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, no GPU (forward stubbed)",
              **measure(args.forward_ms, args.requests), "command": command("single_latency", argv)}
    save(report, args.out)
    h, r = report["httpx"], report["http_client"]
    print(f"POST /infer (one 20-word text) p50: httpx {h['infer_p50_ms']:.2f} ms, http.client {r['infer_p50_ms']:.2f} "
          f"ms; GET /healthz p50: httpx {h['healthz_p50_ms']:.2f}, http.client {r['healthz_p50_ms']:.2f}; forward "
          f"stand-in {args.forward_ms:g} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
