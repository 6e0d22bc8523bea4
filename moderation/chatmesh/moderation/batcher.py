"""Runs checks batched across streams, each under a deadline, so a slow check cannot stall a stream.

Checks from every stream are queued; once per event-loop turn the queue is taken as one batch. Two modes:

- inline (the default, for the embedded classifier, tens of microseconds a check): the batch runs in that
  loop callback. A worker thread would not help here: the checks are pure Python and hold the GIL, and a
  thread only adds hand-offs and the GIL convoy between it and the loop's socket work. The deadline acts as
  load shedding: a check still queued past its deadline is not judged; its `late` function runs instead
  (for an output check, it only slides the window so later chunks still see a phrase split across this one)
  and the caller gets `TimeoutError`, answering with its failure policy.
- threaded (for checks that wait, such as a remote guard model): the batch runs on one worker thread, FIFO so
  each stream's chunks stay in order, and one timer per batch fails the callers still waiting at the
  deadline; results arriving later are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Job(Generic[T]):
    run: Callable[[], T]
    late: Callable[[], object]
    future: asyncio.Future[T]
    deadline: float  # loop.time() at which the caller stops waiting


class CheckBatcher:
    """`await run(fn, late, timeout_s)` returns `fn()`, or raises TimeoutError when the deadline passes."""

    def __init__(self, threaded: bool = False) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="moderation-check") if threaded else None
        self._pending: list[_Job[Any]] = []
        self.batches = 0
        self.checks = 0
        self.shed = 0

    async def run(self, fn: Callable[[], T], late: Callable[[], object], timeout_s: float) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        self._pending.append(_Job(fn, late, future, loop.time() + timeout_s))
        return await future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        self.batches += 1
        self.checks += len(batch)
        if self._executor is None:
            self._run_inline(loop, batch)
            return
        loop.call_at(max(job.deadline for job in batch), _expire, batch)
        self._executor.submit(self._work, loop, batch)

    def _run_inline(self, loop: asyncio.AbstractEventLoop, batch: list[_Job[Any]]) -> None:
        for job in batch:
            if job.future.done():  # the caller went away
                continue
            if loop.time() > job.deadline:
                self.shed += 1
                job.late()
                job.future.set_exception(TimeoutError())
                continue
            try:
                job.future.set_result(job.run())
            except Exception as exc:  # handed to the awaiting caller, which answers with its failure policy
                job.future.set_exception(exc)

    def _work(self, loop: asyncio.AbstractEventLoop, batch: list[_Job[Any]]) -> None:
        results: list[tuple[Any, BaseException | None]] = []
        for job in batch:
            try:
                results.append((job.run(), None))
            except Exception as exc:
                results.append((None, exc))
        try:
            loop.call_soon_threadsafe(_deliver, batch, results)
        except RuntimeError:  # the loop closed while the batch ran: nobody is waiting
            pass


def _expire(batch: list[_Job[Any]]) -> None:
    for job in batch:
        if not job.future.done():
            job.future.set_exception(TimeoutError())


def _deliver(batch: list[_Job[Any]], results: list[tuple[Any, BaseException | None]]) -> None:
    for job, (value, exc) in zip(batch, results):
        if job.future.done():  # timed out or cancelled meanwhile
            continue
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(value)

