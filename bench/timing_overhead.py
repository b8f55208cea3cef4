"""Cost of per-kernel timing (fusedserve_kernel_duration_seconds): encoder forwards with every op timed
(sample rate 1.0) against untimed ones, same inputs, alternating, median of many. The overhead at a sample
rate r is r times the measured per-batch overhead; the default rate is 0.01.

    python -m bench.timing_overhead --device cpu --out bench/results/$(date +%F)-cpu-timing-overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench import command, save
from bench.serve import sentences
from model.runner import Embedder
from server.batcher import KernelTimer
from server.metrics import Metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timing_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--default-rate", type=float, default=0.01)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    embedder, report = Embedder.load("default", device=args.device)
    ids = embedder.tokenizer.encode(sentences(args.batch, 20))
    metrics = Metrics()

    def sync():
        if embedder.device.type == "cuda":
            torch.cuda.synchronize()

    def plain():
        embedder.embed_ids(ids)

    def timed():
        with KernelTimer(embedder.device, metrics):
            embedder.embed_ids(ids)

    for fn in (plain, timed, plain, timed):  # warm-up
        fn()
    samples = {"plain": [], "timed": []}
    for _ in range(args.reps):
        for name, fn in (("plain", plain), ("timed", timed)):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t)
    plain_s, timed_s = statistics.median(samples["plain"]), statistics.median(samples["timed"])
    overhead = (timed_s - plain_s) / plain_s
    result = {
        "device": str(embedder.device), "dtype": str(embedder.dtype), "batch": args.batch, "reps": args.reps,
        "forward_ms": plain_s * 1e3, "timed_forward_ms": timed_s * 1e3, "overhead_at_rate_1": overhead,
        "default_rate": args.default_rate, "overhead_at_default_rate": overhead * args.default_rate,
        "command": command("timing_overhead", argv),
    }
    save(result, args.out)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
