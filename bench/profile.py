"""Where the encoder's GPU time goes: a torch.profiler trace of the forward, kernel time summed by category
(GEMM, attention, norm, activation, elementwise/copy, other) plus the gaps in which the GPU waited for the
host, for the unfused reference path and for each fused path (eager and CUDA graphs). The seeds' rule:
profile first, fuse what dominates.

    python -m bench.profile --out bench/results/$(date +%F)-h200-profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench import command, save
import kernels
from model.config import EncoderConfig
from model.encoder import Encoder, Packed, ffn_splits, packed_mean_pool
from model.graphs import CudaGraphs

CATEGORIES = [  # first match wins: attention before GEMM (cutlass fmha kernels would match both)
    ("attention", r"flash|fmha|attention|efficient_attention|softmax"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|linear_gelu|linear_add_ln"),  # ours: GEMM + epilogue
    ("norm", r"layer_norm|layernorm|norm_kernel|_norm"),
    ("activation", r"gelu|erf"),
    ("elementwise", r"elementwise|vectorized|index|copy|fill|cat|scatter|gather|reduce|arange|compare"),
]


def category(name: str) -> str:
    lowered = name.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def breakdown(fn, iters: int = 20) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / iters
    totals: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    kernels_seen = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels_seen += 1
            totals[category(event.name)] = totals.get(category(event.name), 0.0) + event.device_time / iters
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time / iters
    busy = sum(totals.values())
    totals["launch gaps (GPU idle)"] = max(wall_us - busy, 0.0)
    return {"wall_us": wall_us, "kernels_per_forward": kernels_seen / iters,
            "us": {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_kernels_us": {k[:120]: round(v, 2) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    parser.add_argument("--attention", choices=["pad", "varlen", "fused"], default="pad",
                        help="the fused backends' packed attention (the unfused reference keeps pad)")
    parser.add_argument("--ffn-chunks", type=int, nargs="+", default=[64],
                        help="with --attention fused: profile the few-token layer once per FFN chunk width (columns "
                             "of the intermediate per ffn_partials program; wider: fewer partial sums to add up)")
    parser.add_argument("--without-pdl", action="store_true",
                        help="the Triton backend's graphs a second time with programmatic dependent launch off "
                             "(FUSEDSERVE_TRITON_PDL=0; on by default on Hopper). Under the profiler a kernel launched "
                             "with it counts its wait for the previous one: compare walls, not categories")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    cfg = EncoderConfig.from_name(args.preset)
    encoder = Encoder(cfg).cuda().half().eval()
    gen = torch.Generator().manual_seed(0)
    rows = [[101] + torch.randint(1000, 30000, (args.seq - 2,), generator=gen).tolist() + [102]
            for _ in range(args.batch)]
    packed = Packed.from_rows(rows, "cuda")
    results = {}
    from kernels.triton._common import pdl_enabled, pdl_launches

    with torch.inference_mode():
        chunks = args.ffn_chunks if args.attention == "fused" else [None]
        for name, backend, fused, chunk in [("reference (unfused torch)", "torch", False, None),
                                            *[(f"fused {b}" + (f" (FFN chunk {c})" if len(chunks) > 1 else ""), b, True,
                                               c) for b in args.backends for c in chunks]]:
            kernels.configure("cuda", (torch.float16,), backend=backend, fused=fused, hidden_sizes=(cfg.hidden_size,))
            attention = args.attention if fused else "pad"
            for layer in encoder.layers:
                layer.ffn_splits = ffn_splits(cfg.intermediate_size, chunk or 64)
            results[f"{name} eager"] = breakdown(
                lambda: packed_mean_pool(encoder.forward_packed(packed, attention), packed, False))
            pdl_on = pdl_enabled()  # the process's setting; --without-pdl adds the Triton graphs without it
            for pdl in ([pdl_on, False] if args.without_pdl and backend == "triton" and pdl_on else [pdl_on]) \
                    if fused else []:
                with pdl_launches(pdl):  # replays keep what was captured
                    graphs = CudaGraphs(encoder, torch.device("cuda"), max_tokens=args.batch * args.seq,
                                        max_batch=args.batch, attention=attention)
                    results[f"{name} graphs{'' if pdl == pdl_on else ' no-pdl'}"] = breakdown(lambda: graphs.run(rows))
                    graphs = None
            for mode in ("eager", "graphs", "graphs no-pdl"):
                if (r := results.get(f"{name} {mode}")) is not None:
                    print(f"{name}: {r['wall_us']:.0f} us/forward {mode}, {r['kernels_per_forward']:.0f} kernels: "
                          f"{r['us']}", file=sys.stderr, flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "case": f"{args.preset} b{args.batch} s{args.seq} fp16 packed", "attention": args.attention,
              "results": results,
              "command": command("profile", argv)}
    save(report, args.out)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
