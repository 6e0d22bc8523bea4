"""Runs checks off the event loop, batched across streams, each under a deadline.

Every check (a short pure-Python call) is queued; once per event-loop iteration the queue is handed, as one
batch, to a single worker thread, which runs the batch in order and returns all results with one wake-up of
the loop. One thread hand-off per batch instead of per check keeps the cost flat as streams multiply, and FIFO
order on one worker keeps each stream's chunks (and its window) in order.

The caller awaits its own result with a deadline: if the worker is slow or stuck (a pathological regex in a
custom policy), the caller gets `TimeoutError` at the deadline and applies its failure policy, so a slow check
cannot stall a stream; the late result is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
_Job = tuple[Callable[[], T], "asyncio.Future[T]"]


class CheckBatcher(Generic[T]):
    """One worker thread fed with batches. `run(fn, timeout_s)` returns `fn()` or raises TimeoutError."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="moderation-check")
        self._pending: list[_Job[T]] = []
        self.batches = 0
        self.checks = 0

    async def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        self._pending.append((fn, future))
        return await asyncio.wait_for(future, timeout_s)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if batch:
            self.batches += 1
            self.checks += len(batch)
            self._executor.submit(self._work, loop, batch)

    def _work(self, loop: asyncio.AbstractEventLoop, batch: list[_Job[T]]) -> None:
        results: list[tuple[T | None, BaseException | None]] = []
        for fn, _ in batch:
            try:
                results.append((fn(), None))
            except Exception as exc:  # handed to the awaiting caller, which answers with a status
                results.append((None, exc))
        try:
            loop.call_soon_threadsafe(_deliver, batch, results)
        except RuntimeError:  # the loop closed while the batch ran: nobody is waiting
            pass


def _deliver(batch: list[_Job[T]], results: list[tuple[T | None, BaseException | None]]) -> None:
    for (_, future), (value, exc) in zip(batch, results):
        if future.done():  # timed out or cancelled meanwhile
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)  # type: ignore[arg-type]
