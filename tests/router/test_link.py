"""The link model (router/chatmesh/router/link.py): the reference node's figures and the pull/prefill break-even."""

from __future__ import annotations

import pytest

from chatmesh.router.capacity import plan
from chatmesh.router.link import DEFAULT_COST, Link, PrefixCost


def test_reference_node_moves_a_3000_token_prefix_far_cheaper_than_prefill() -> None:
    assert DEFAULT_COST.kv_bytes_per_token == 160 * 1024
    assert DEFAULT_COST.link.bandwidth_bytes_s == 400e9  # 8 x 400 Gb/s
    assert DEFAULT_COST.pull_s(3000) == pytest.approx(0.0005 + 3000 * 163840 / 400e9)
    assert DEFAULT_COST.prefill_s(3000) == pytest.approx(3000 / 44_850, rel=1e-3)
    one = PrefixCost.from_plan(plan(), Link.from_gbps(400, 1))
    assert one.pull_s(3000) == pytest.approx(0.0103, abs=1e-4)  # the issue's ~10 ms on a single link
    assert DEFAULT_COST.pull_s(0) == 0.0 and not DEFAULT_COST.worth_pulling(0)


def test_break_even_is_the_smallest_pull_worth_its_latency() -> None:
    n = DEFAULT_COST.break_even_tokens()
    assert DEFAULT_COST.worth_pulling(n) and not DEFAULT_COST.worth_pulling(n - 1)
    slow = PrefixCost(Link(1e6, 0.0), 163840, 44_850.0)  # 1 MB/s: slower per token than prefill
    assert not slow.worth_pulling(10_000)
    with pytest.raises(ValueError):
        slow.break_even_tokens()
    with pytest.raises(ValueError):
        Link(0.0)
