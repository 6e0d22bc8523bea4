"""reload.Watched: a change to the files is read at the first check after `check_every_s`, not before (the clock
is moved, not waited on); a forced check reads it at once; a change that does not parse keeps the old value."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from chatmesh.mesh import reload


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def parse(data: Sequence[bytes]) -> str:
    text = data[0].decode()
    if not text.isdigit():
        raise ValueError(f"not a number: {text!r}")
    return text


def rewrite(path: Path, text: str) -> None:
    new = path.with_suffix(".new")
    new.write_text(text)
    new.replace(path)  # a new inode, as pki.write_atomic writes


def test_a_change_is_seen_at_the_next_check(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "value"
    path.write_text("1")
    watched = reload.Watched([path], parse, check_every_s=1.0, clock=clock)
    rewrite(path, "2")
    clock.now += 0.9
    assert watched.current() == "1" and watched.generation == 0  # not checked yet
    clock.now += 0.2
    assert watched.current() == "2" and watched.generation == 1
    rewrite(path, "3")
    assert watched.current() == "2"  # checked 0 s ago
    assert watched.current(force=True) == "3" and watched.generation == 2


def test_a_change_that_does_not_parse_keeps_the_value_and_is_retried(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "value"
    path.write_text("1")
    watched = reload.Watched([path], parse, check_every_s=1.0, clock=clock)
    rewrite(path, "half-written")
    clock.now += 1.1
    assert watched.current() == "1" and watched.generation == 0
    rewrite(path, "4")
    clock.now += 1.1
    assert watched.current() == "4" and watched.generation == 1
