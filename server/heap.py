"""Giving freed heap memory back after large requests. A request with a lot of text, or with a large answer, frees
hundreds of MB on its way out (the tokenizer's buffers, the parsed body, the answer), and two things keep that memory
from the OS in an idle process: reference cycles, which only the garbage collector frees and which it looks for only
as objects are allocated (an idle process allocates none): an exception's traceback holds the frames it passed
through, and their buffers with them (a 413 raised after tokenizing holds every token of its request); and glibc's
malloc, which keeps freed memory in its arenas rather than returning it to the OS, so that a burst of the largest
allowed requests leaves a process far above its idle size (docs/decisions/0029-freed-heap-given-back.md). So,
shortly after a large request is answered, once for any number answered meanwhile: one full collection, on the event
loop (the finalizers it runs expect that thread), then `malloc_trim(0)` on a worker thread, which returns the free
pages."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging

log = logging.getLogger("fusedserve")

# bodies at least this large are followed by a trim: a full-size sentence-transformers request (256 texts) is well
# above it, a request of a few sentences far below
LARGE_BODY_BYTES = 64 * 1024
# and answers at least this large: /tokenize's and /embed_all's grow with every token of a small body; an embedding
# request of tens of inputs answers far less, so a steady load of those is not trimmed every TRIM_DELAY_S
LARGE_ANSWER_BYTES = 1024 * 1024
TRIM_DELAY_S = 0.5  # a burst of large requests is trimmed once, after it


# malloc_trim gives back the free pages inside each of glibc's heaps but never the free space at the top of a thread's
# heap (the tokenizer's threads, the workers that prepare requests and build answers: each has a heap of its own),
# and glibc returns that only past a threshold that it raises (to twice the largest block it has unmapped, up to
# 64 MiB, a whole thread heap), so after a burst the tokenizer's threads would keep what they had freed. Both
# thresholds are fixed instead (setting one stops glibc moving either): a heap's free top beyond TOP_TRIM_BYTES goes
# back as it is freed, and blocks from MMAP_BYTES on are mapped on their own (glibc's ceiling for its moving
# threshold: smaller blocks reuse heap memory, as they would once glibc had moved the threshold there).
TOP_TRIM_BYTES = 8 * 1024 * 1024
MMAP_BYTES = 32 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def _libc_function(name: str):
    """glibc's `name`, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    return _libc_function("malloc_trim")


def fix_malloc_thresholds() -> bool:
    """Once per process, before it serves: glibc's trim and mmap thresholds fixed at TOP_TRIM_BYTES and MMAP_BYTES
    (above). False where the C library has no mallopt or refused a value."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TOP_TRIM_BYTES))


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._scheduled = False
        self.trims = 0

    def after_large_request(self) -> None:
        """Called on the event loop once a large request has been answered."""
        if self._scheduled:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, lambda: asyncio.ensure_future(self._run()))

    async def _run(self) -> None:
        self._scheduled = False
        try:
            gc.collect()
            if self._trim is not None:  # another C library returns freed memory on its own terms
                await asyncio.to_thread(self._trim, 0)
                self.trims += 1
        except Exception:  # never a request's problem
            log.exception("giving freed heap memory back failed")
