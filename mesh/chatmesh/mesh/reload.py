"""Files that are re-read when they change (certificates, token keys), so they rotate without a restart.

`Watched(paths, parse)` holds the value parsed from a set of files. `current()` looks at the files' (inode, size,
mtime) at most once per `check_every_s` (a stat per file: cheap enough to sit on a per-call path) and re-parses
when any changed. A change that does not parse (a key file written before its certificate, a half-copied file
by a tool that does not rename) keeps the previous value and is retried at the next check: a service never drops
a working configuration for a broken one, and says so once per distinct failure.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from chatmesh.mesh import logs

log = logs.get("chatmesh.reload")

T = TypeVar("T")
CHECK_EVERY_S = 1.0

Signature = tuple[tuple[int, int, int], ...]


def _signature(paths: Sequence[Path]) -> Signature:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            out.append((0, -1, 0))
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class Watched(Generic[T]):
    """The value parsed from `paths` (parse gets their bytes, in order), re-parsed when they change."""

    def __init__(self, paths: Sequence[Path], parse: Callable[[Sequence[bytes]], T],
                 check_every_s: float = CHECK_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = tuple(paths)
        self._clock = clock
        self._parse = parse
        self._every = check_every_s
        self._lock = threading.Lock()  # the TLS fetcher runs on gRPC's threads
        self._signature = _signature(self.paths)
        self._value = parse([p.read_bytes() for p in self.paths])  # a broken first load is an error at start
        self.generation = 0
        self._next_check = clock() + self._every
        self._last_error = ""

    def current(self, force: bool = False) -> T:
        now = self._clock()
        if not force and now < self._next_check:
            return self._value
        with self._lock:
            self._next_check = now + self._every
            signature = _signature(self.paths)
            if signature != self._signature:
                try:
                    value = self._parse([p.read_bytes() for p in self.paths])
                except (OSError, ValueError) as err:
                    if str(err) != self._last_error:
                        self._last_error = str(err)
                        log.warning("reload_refused", files=[str(p) for p in self.paths], error=str(err))
                    return self._value
                self._value, self._signature, self._last_error = value, signature, ""
                self.generation += 1
                log.info("reloaded", files=[str(p) for p in self.paths], generation=self.generation)
            return self._value
