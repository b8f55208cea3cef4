"""Launch-configuration choice for the CUDA kernels: the first call of a kernel at a new shape class times every
candidate configuration (kernels.timing.device_us: CUDA-graph replays, so it is device time, not Python overhead)
and keeps the fastest; results are cached in memory and in a JSON file per GPU model in the cache directory
(kernels.cache), so later processes on the same kind of GPU start tuned. A cache file that cannot be read is
reported once and rebuilt by the next save. `table()` is what was chosen (the bench JSON and /info record it).

Shape class: (kernel, dtype, cols, power-of-two bucket of the row count). Below TUNE_MIN_ROWS rows every
configuration is a single wave bound by launch latency, so the heuristic is taken without a sweep (this also
keeps the registry's small self-test shapes from tuning). FUSEDSERVE_CUDA_TUNE=0 skips the sweep everywhere;
so does a call made while a CUDA graph is being captured.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fusedserve.kernels import cache
from fusedserve.kernels._layout import row_bucket
from fusedserve.kernels.timing import device_us

log = logging.getLogger("fusedserve.kernels.cuda")

Config = tuple[int, int]

# LayerNorm family: (threads per row, threads per block). Values per thread are capped at 32 (registers).
NORM_THREADS_PER_ROW = (32, 64, 128, 256, 512)
NORM_BLOCKS = (128, 256, 512)
# bias(+residual)+GELU: (threads per block, rows each thread walks)
POINTWISE_CONFIGS: tuple[Config, ...] = tuple((t, r) for t in (128, 256, 512, 1024) for r in (1, 4, 16))
VALUES_PER_THREAD = 32
TUNE_MIN_ROWS = 256


def _min_threads_per_row(cols: int) -> int:
    return next(t for t in NORM_THREADS_PER_ROW if t * VALUES_PER_THREAD >= cols)


def norm_candidates(cols: int) -> list[Config]:
    """Configs that fit a row of `cols`; the first is the heuristic default."""
    least = _min_threads_per_row(cols)
    tprs = [t for t in NORM_THREADS_PER_ROW if least <= t <= 4 * least]
    default = (least, max(256, least))
    return [default] + [(t, b) for t in tprs for b in NORM_BLOCKS if b >= t and (t, b) != default]


def pointwise_candidates(cols: int, rows: int | None = None) -> list[Config]:
    """Configs for bias(+residual)+GELU over rows of `cols`; the first is the heuristic default: 4 rows per thread,
    but 1 below TUNE_MIN_ROWS rows (those take the default untuned). There the grid is one partial wave, and every
    extra row a thread walks is one more memory round trip in series: on a few-token batch a 4-row default leaves a
    handful of blocks each walking 4 rows one after another, where one row per thread spreads them over the GPU."""
    default = (256, 1) if rows is not None and rows < TUNE_MIN_ROWS else (256, 4)
    return [default] + [c for c in POINTWISE_CONFIGS if c != default]


def _enabled() -> bool:
    return os.environ.get("FUSEDSERVE_CUDA_TUNE", "1") != "0"


def _valid_table(table: object) -> bool:
    """A loaded cache is used only whole: a JSON object of entries each holding a two-int config."""
    return isinstance(table, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("config"), list) and len(entry["config"]) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in entry["config"])
        for entry in table.values())


class Tuner:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, dict] = {}  # "kernel|dtype|cols|bucket" -> config and timings (the JSON file)
        self._chosen: dict[tuple, Config] = {}  # the same choices by tuple key: the per-launch lookup
        self._file: Path | None = None
        self._save_failed = False  # warned once already

    def _cache_file(self) -> Path:
        """The GPU model's cache file (kernels.cache: keyed by the GPU, the versions and the kernel sources), its
        table loaded on first use. A missing file is a first start; one that cannot be read or parsed is reported
        and replaced by the next save (its entries would be re-tuned anyway, and silently ignoring it would leave
        every later start re-tuning with nobody told why)."""
        if self._file is None:
            self._file = cache.gpu_file("tuning")
            shipped = cache.shipped("tuning")  # this GPU model's shipped table, under what this machine saved
            self._table.update({k: v for k, v in shipped.items() if _valid_table({k: v})})
            self._table.update(cache.read_table(self._file, _valid_table, "CUDA tuning cache"))
        return self._file

    def _save(self, key: str) -> None:
        # kernels.cache.merge_table: under a lock file, so replicas sharing the cache directory keep each other's
        # entries, and a reader never sees half a file. A read-only cache only costs a re-tune next start: said once.
        error = cache.merge_table(self._file, _valid_table, "CUDA tuning cache",
                                  lambda table: table.update({key: self._table[key]}))
        if error is not None and not self._save_failed:
            log.warning("cannot save the CUDA tuning cache %s (%s: %s); tuned configs last only this process",
                        self._file, type(error).__name__, error)
            self._save_failed = True

    def choose(self, kernel: str, dtype: torch.dtype, cols: int, rows: int, candidates: Sequence[Config],
               run: Callable[[Config], None]) -> Config:
        if rows < TUNE_MIN_ROWS or len(candidates) == 1:
            return candidates[0]  # launch-latency bound: nothing to tune, nothing recorded
        fast_key = (kernel, dtype, cols, row_bucket(rows))
        chosen = self._chosen.get(fast_key)
        if chosen is not None:
            return chosen
        key = f"{kernel}|{str(dtype).removeprefix('torch.')}|{cols}|{row_bucket(rows)}"
        if self._file is None:
            with self._lock:
                self._cache_file()
        hit = self._table.get(key)
        if hit is not None:
            self._chosen[fast_key] = tuple(hit["config"])
            return self._chosen[fast_key]
        if not _enabled() or torch.cuda.is_current_stream_capturing():
            return candidates[0]
        with self._lock:
            timings = {}
            for config in candidates:
                try:
                    timings[config] = device_us(lambda: run(config), calls=10, rounds=5, reduce="median")
                except RuntimeError as exc:  # a config this shape cannot take is skipped, not fatal
                    log.debug("cuda tune %s %s: skipped (%s)", key, config, exc)
            if not timings:
                return candidates[0]
            best = min(timings, key=timings.get)
            self._table[key] = {"config": list(best), "us": round(timings[best], 3),
                                "heuristic_us": round(timings.get(candidates[0], float("nan")), 3),
                                "candidates": len(timings)}
            log.info("cuda tune %s x %d rows: %s %.2f us (heuristic %s %.2f us, %d candidates)", key, rows, best,
                     timings[best], candidates[0], timings.get(candidates[0], float("nan")), len(timings))
            self._save(key)
            self._chosen[fast_key] = best
            return best

    def table(self) -> dict[str, dict]:
        return dict(self._table)

    def clear(self) -> None:
        self._table.clear()
        self._chosen.clear()


TUNER = Tuner()
