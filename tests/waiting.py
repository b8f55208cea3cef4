"""Waiting for what a test needs to have happened (a server's state, another thread's step) by polling it within a
deadline, never by a fixed sleep: a loaded machine takes longer than any sleep chosen on an idle one, and an idle one
wastes the rest of it. A test's own fixed sleep is the behaviour under test (a client slow on purpose) and says so.

wait_until (from a plain test or a thread) and wait_until_async (inside a running event loop, which must keep serving
the tasks the test waits on) poll `predicate` until it returns something truthy and return it; past `timeout`
seconds the test fails with `message`."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def _failure(message: str | Callable[[], str], timeout: float) -> str:
    text = message() if callable(message) else message
    return f"{text} (waited {timeout:g} s)"


def wait_until(predicate: Callable[[], T], timeout: float, message: str | Callable[[], str],
               interval: float = 0.05) -> T:
    """The first truthy value of `predicate()`, polled every `interval` seconds; past `timeout` seconds, a failure
    with `message` (a string, or a callable giving one then: the state that was not reached)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(_failure(message, timeout))
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float, message: str | Callable[[], str],
                           interval: float = 0.01) -> T:
    """wait_until inside an event loop: the loop runs its other tasks between two polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(_failure(message, timeout))
        await asyncio.sleep(interval)
    return value
