"""Forward time of the packed vs the padded layout on the same batches (same process, same weights).

    python -m bench.layouts --device cpu --out bench/results/$(date +%F)-cpu-layouts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench import command, save
from bench.serve import mixed_texts, sentences
from model.runner import Embedder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    embedders = {layout: Embedder.load("default", device=args.device, layout=layout, cuda_graphs=False)[0]
                 for layout in ("packed", "padded")}
    cases = {f"{args.batch} x 20-word sentences": sentences(args.batch, 20),
             f"{args.batch} mixed 1-60-word texts, length-sorted": sorted(mixed_texts(args.batch, high=60), key=len)}
    results = []
    for name, texts in cases.items():
        ids = embedders["packed"].tokenizer.encode(texts)
        times: dict[str, list[float]] = {layout: [] for layout in embedders}
        for e in embedders.values():
            e.embed_ids(ids)  # warm
        for _ in range(args.repeats):  # interleaved, so drift of this shared machine hits both layouts alike
            for layout, e in embedders.items():
                started = time.perf_counter()
                e.embed_ids(ids)
                times[layout].append(time.perf_counter() - started)
        for layout, samples in times.items():
            results.append({"case": name, "layout": layout, "ms": statistics.median(samples) * 1e3,
                            "min_ms": min(samples) * 1e3, "max_ms": max(samples) * 1e3,
                            "tokens": sum(map(len, ids)), "padded_tokens": len(ids) * max(map(len, ids))})
            r = results[-1]
            print(f"{name}: {layout} {r['ms']:.1f} ms (min {r['min_ms']:.1f}, max {r['max_ms']:.1f})", file=sys.stderr)
    report = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "command": command("layouts", argv), "results": results}
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
