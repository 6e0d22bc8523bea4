"""The store's time: Unix epoch milliseconds from a clock the caller may replace (tests move it), and UTC days
(the usage table's key, retention's unit)."""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable

Clock = Callable[[], int]
DAY_MS = 86_400_000


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def utc_day(ms: int) -> str:
    return _utc_day(ms // DAY_MS)


@functools.lru_cache(maxsize=8)
def _utc_day(day_number: int) -> str:
    return datetime.datetime.fromtimestamp(day_number * 86_400, tz=datetime.UTC).strftime("%Y-%m-%d")
