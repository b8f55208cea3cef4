"""Where one request's forward goes on the GPU: a batch at a time through the Embedder, as the server's worker runs
a lone request (host packing, H2D copy, CUDA-graph replay, D2H copy into pinned memory, event wait), split into
its steps, next to the graph's device time alone and to the pipelined rate bench.encoder reports.

    python -m bench.serial_forward --model .gpu-assets/minilm --out bench/results/$(date +%F)-h200-serial-forward.json

Per case (a 20-word sentence as the server tokenizes it; one 16-token row):
- device_ms: the graph replay alone, CUDA events around back-to-back replays (what the GPU spends);
- pipelined_ms: Embedder.launch_ids back to back with no wait in between (bench.encoder's packed-graphs number:
  host work hides behind the previous replay);
- serial: launch_ids(rows).wait() after the device went idle, with --gaps milliseconds of idle before each call
  (a lone client leaves the GPU idle between requests): total, launch (host packing + copies + replay launch,
  until launch_ids returns) and wait (until the result is on the host), medians over --count calls.
The serial total minus device_ms is what the host and the round trip add to a lone request.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import command, save
from bench.serve import sentences


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def device_ms(embedder, rows: list[list[int]], count: int) -> float:
    """The replay of rows' graph alone: CUDA events around each of `count` back-to-back replays, median."""
    graphs = embedder.graphs
    key = graphs.bucket(rows)
    graphs.run(rows)  # captured on first use
    graph = graphs.graphs[key].graph
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in pairs:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def pipelined_ms(embedder, rows: list[list[int]], count: int) -> float:
    """launch_ids back to back, one wait at the end: the per-call time once host work overlaps the device."""
    embedder.launch_ids(rows).wait()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(count):
        pending = embedder.launch_ids(rows)
    pending.wait()
    return (time.perf_counter() - started) / count * 1e3


def idle(gap_ms: float, spin: bool) -> None:
    """Leave the device idle for gap_ms: asleep (the core may drop into a deeper idle state) or spinning on the
    clock (the core stays busy)."""
    if not spin:
        time.sleep(gap_ms / 1e3)
        return
    until = time.perf_counter() + gap_ms / 1e3
    while time.perf_counter() < until:
        pass


def serial(embedder, rows: list[list[int]], count: int, gap_ms: float, spin: bool = False) -> dict:
    launch, wait, total = [], [], []
    for _ in range(count):
        torch.cuda.synchronize()
        if gap_ms:
            idle(gap_ms, spin)
        t0 = time.perf_counter()
        pending = embedder.launch_ids(rows)
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        wait.append(t2 - t1)
        total.append(t2 - t0)
    return {"gap_ms": gap_ms, "spin": spin, "total_ms": _median_ms(total), "launch_ms": _median_ms(launch),
            "wait_ms": _median_ms(wait), "p99_total_ms": sorted(total)[int(0.99 * (count - 1))] * 1e3}


def steps(embedder, rows: list[list[int]], count: int, gap_ms: float, spin: bool) -> dict:
    """The serial call's steps, each timed on the host: the same calls as CudaGraphs.run + Embedder.launch_ids
    (pack on the host, H2D copies, replay, pinned D2H copy + event), then the wait. Pack is numpy only: when it
    slows down after an idle gap as much as the CUDA calls do, the host core, not the driver, is what woke slowly."""
    from model.encoder import Packed
    from model.graphs import _split

    graphs = embedder.graphs
    key = graphs.bucket(rows)
    entry = graphs.graphs[key]
    tokens, batch, seq, _ = key
    names = ("pack", "h2d", "replay", "d2h", "wait")
    times = {name: [] for name in names}
    for _ in range(count):
        torch.cuda.synchronize()
        if gap_ms:
            idle(gap_ms, spin)
        t = [time.perf_counter()]
        _, lengths = Packed.host_buffers(rows, tokens, batch, seq, graphs.pad_token_id, out=_split(entry.host, tokens))
        Packed.host_cu_seqlens(lengths[: len(rows)].numpy(), batch, out=entry.cu_host)
        t.append(time.perf_counter())
        entry.device.copy_(entry.host, non_blocking=True)
        entry.cu_device.copy_(entry.cu_host, non_blocking=True)
        t.append(time.perf_counter())
        entry.graph.replay()
        t.append(time.perf_counter())
        host = torch.empty(entry.pooled[: len(rows)].shape, dtype=entry.pooled.dtype, pin_memory=True)
        host.copy_(entry.pooled[: len(rows)], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        t.append(time.perf_counter())
        done.synchronize()
        t.append(time.perf_counter())
        for name, a, b in zip(names, t, t[1:]):
            times[name].append(b - a)
    return {"gap_ms": gap_ms, "spin": spin, **{f"{name}_ms": _median_ms(v) for name, v in times.items()}}


def hold_cpu_dma_latency(us: int):
    """Ask the kernel's PM QoS to keep every core out of idle states slower to leave than `us` microseconds (what
    tuned's latency-performance profile does), for as long as the returned file stays open; None where not allowed."""
    try:
        f = open("/dev/cpu_dma_latency", "wb", buffering=0)
        f.write(int(us).to_bytes(4, "little"))
        return f
    except OSError as exc:
        print(f"/dev/cpu_dma_latency: {exc}", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint directory, preset name or 'default'")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 1.0, 5.0],
                        help="idle milliseconds before each serial call")
    parser.add_argument("--spin", action="store_true", help="also each gap spent spinning instead of asleep")
    parser.add_argument("--steps", action="store_true", help="also each serial call's steps (pack, copies, replay, wait)")
    parser.add_argument("--cpu-dma-latency-us", type=int, help="hold /dev/cpu_dma_latency at this value for the run")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.serial_forward needs a CUDA device")

    from model.runner import Embedder

    qos = hold_cpu_dma_latency(args.cpu_dma_latency_us) if args.cpu_dma_latency_us is not None else None

    print(f"loading {args.model} (kernel self-tests and timing) ...", flush=True)
    embedder, report = Embedder.load(args.model, device="cuda", dtype=args.dtype, backend=args.backend)
    print(report, flush=True)
    cases = {"20-word sentence": embedder.tokenizer.encode(sentences(1, 20)),
             "b1 s16": [[101] + [2000 + i for i in range(14)] + [102]]}
    results = []
    for name, rows in cases.items():
        row = {"case": name, "tokens": sum(map(len, rows)), "bucket": list(embedder.graphs.bucket(rows)),
               "device_ms": device_ms(embedder, rows, args.count),
               "pipelined_ms": pipelined_ms(embedder, rows, args.count),
               "serial": [serial(embedder, rows, args.count, gap, spin)
                          for spin in ((False, True) if args.spin else (False,))
                          for gap in args.gaps if gap or not spin]}
        if args.steps:
            row["steps"] = [steps(embedder, rows, args.count, gap, spin)
                            for spin in ((False, True) if args.spin else (False,))
                            for gap in args.gaps if gap or not spin]
        results.append(row)
        print(f"{name} ({row['tokens']} tokens, bucket {tuple(row['bucket'])}): device {row['device_ms']:.3f} ms, "
              f"pipelined {row['pipelined_ms']:.3f} ms/call", flush=True)
        for s in row["serial"]:
            print(f"  serial, {s['gap_ms']:g} ms {'spinning' if s['spin'] else 'idle'} before each: {s['total_ms']:.3f} ms "
                  f"(launch {s['launch_ms']:.3f}, wait {s['wait_ms']:.3f}; p99 {s['p99_total_ms']:.3f})", flush=True)
        for s in row.get("steps", []):
            print(f"  steps, {s['gap_ms']:g} ms {'spinning' if s['spin'] else 'idle'} before each: " +
                  ", ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in s.items() if k.endswith("_ms")), flush=True)
    save({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
          "cpu_dma_latency_us": args.cpu_dma_latency_us if qos is not None else None,
          "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
          "kernels": {op: choice.backend for op, choice in report.kernels.choices.items()},
          "results": results, "command": command("serial_forward", argv)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
