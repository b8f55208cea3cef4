"""Giving freed heap memory back after large requests. A request with a lot of text frees hundreds of MB on its way
out (the tokenizer's buffers, the parsed body, the answer), and glibc's malloc keeps freed memory in its arenas rather
than returning it to the OS: after a burst of the largest allowed requests a process stayed ~600 MB above its idle
size. `malloc_trim(0)` returns the free pages; it runs on a worker thread, shortly after a large request is answered,
once for any number answered meanwhile."""

from __future__ import annotations

import asyncio
import ctypes
import logging

log = logging.getLogger("fusedserve")

# bodies at least this large are followed by a trim (a full-size sentence-transformers request of 256 texts is ~0.5 MB)
LARGE_BODY_BYTES = 64 * 1024
TRIM_DELAY_S = 0.5  # a burst of large requests is trimmed once, after it


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._scheduled = False
        self.trims = 0

    def after_large_request(self) -> None:
        """Called on the event loop once a large request has been answered."""
        if self._trim is None or self._scheduled:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, lambda: asyncio.ensure_future(self._run()))

    async def _run(self) -> None:
        self._scheduled = False
        try:
            await asyncio.to_thread(self._trim, 0)
            self.trims += 1
        except Exception:  # never a request's problem
            log.exception("malloc_trim failed")
