"""The engine's own cost per request, the forward left out: `python -m bench.engine_overhead [--points 1x64 2x64 ...]`.

An engine (server.engine) whose one model answers every batch at once with zeros (a null ServedModel behind the
real Batcher), fed by client processes (server.engine_client) that each keep `concurrency` one-text requests in
flight. Per point: requests/s, and the engine process's CPU time per request: what the engine spends to unpack,
queue, batch, answer and pack a request, the part of the host path that one engine process cannot spread over
front-ends (docs/decisions/0031-engine-transport.md). Prints a table; nothing is written."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import tempfile
import time
import types

import numpy as np

WIDTH = 384  # MiniLM's
TOKENS = 12  # a short sentence's ids


def _engine(address: str, seconds: float, report: mp.Queue) -> None:
    from fusedserve.model.api import Description
    from fusedserve.server.batcher import Batcher
    from fusedserve.server.config import Settings
    from fusedserve.server.engine import Engine
    from fusedserve.server.metrics import Metrics

    class Answered:
        path = "fused"

        def __init__(self, n: int) -> None:
            self.n = n

        def ready(self) -> bool:
            return True

        def rows(self) -> np.ndarray:
            return np.zeros((self.n, WIDTH), np.float32)

    class NullModel:
        def launch(self, rows, output="pooled", reference=False):
            return Answered(len(rows))

        def describe(self) -> Description:
            return Description("null", "embedding", WIDTH, 512, "cpu")

    settings = Settings(model="tiny", device="cpu", max_queue=1 << 20, verify_sample_rate=0,
                        kernel_timing_sample_rate=0)
    metrics = Metrics("cpu").for_model("null")
    batcher = Batcher(NullModel(), settings, metrics)
    batcher.start()
    served = types.SimpleNamespace(batcher=batcher, settings=settings, cost_model=None, metrics=metrics, name="null")

    async def main() -> None:
        engine = Engine([served], address)
        task = asyncio.create_task(engine.serve())
        report.put("ready")
        started = time.process_time()
        await asyncio.sleep(seconds)
        report.put(time.process_time() - started)
        task.cancel()

    asyncio.run(main())


def _client(address: str, seconds: float, concurrency: int, report: mp.Queue) -> None:
    from fusedserve.model.api import Rows
    from fusedserve.server.engine_client import EngineClient

    rows = Rows.of([[101, *range(1000, 1000 + TOKENS - 2), 102]])

    async def main() -> None:
        client = EngineClient(address)
        client.start()
        await client.submit(0, rows, 30).future  # connected
        done, end = 0, time.monotonic() + seconds

        async def one() -> None:
            nonlocal done
            while time.monotonic() < end:
                await client.submit(0, rows, 30).future
                done += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
        report.put(done)

    asyncio.run(main())


def point(clients: int, concurrency: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{folder}/engine.sock"
        engine_report, client_report = mp.Queue(), mp.Queue()
        # the engine outlives the clients' window by their start-up (imports, connecting)
        engine = mp.Process(target=_engine, args=(address, seconds + 10, engine_report))
        engine.start()
        assert engine_report.get(timeout=120) == "ready"
        started = time.monotonic()
        workers = [mp.Process(target=_client, args=(address, seconds, concurrency, client_report))
                   for _ in range(clients)]
        for w in workers:
            w.start()
        requests = sum(client_report.get(timeout=seconds + 120) for _ in workers)
        for w in workers:
            w.join()
        window = time.monotonic() - started
        engine_cpu = engine_report.get(timeout=seconds + 60)
        engine.join()
    return {"point": f"{clients}x{concurrency}", "requests_per_s": requests / seconds,
            "engine_cpu_us_per_request": engine_cpu / requests * 1e6, "window_s": window}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_overhead", description=__doc__)
    parser.add_argument("--points", nargs="+", default=["1x64", "2x64", "1x256"],
                        help="CLIENTSxCONCURRENCY: client processes, requests each keeps in flight")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    print(f"{'point':>8} {'requests/s':>11} {'engine CPU us/request':>22}  ({os.cpu_count()} CPUs)")
    for spec in args.points:
        clients, concurrency = map(int, spec.split("x"))
        r = point(clients, concurrency, args.seconds)
        print(f"{r['point']:>8} {r['requests_per_s']:>11.0f} {r['engine_cpu_us_per_request']:>22.1f}")


if __name__ == "__main__":
    main()
