"""`chatmesh simulate` reproduces the reference's hit-rate table within one point, and its extensions behave."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chatmesh.mesh.cli import main
from chatmesh.router import simulate
from chatmesh.router.simulate import Policy, PolicySpec, SimConfig


def test_reference_table_within_one_point() -> None:
    cfg = SimConfig()
    schedule = simulate.arrivals(cfg)
    rnd = simulate.route(PolicySpec(Policy.RANDOM), cfg, schedule)
    mod = simulate.route(PolicySpec(Policy.MODULO), cfg, schedule)
    for cap, ref_r, ref_a in zip(simulate.REFERENCE_CACHES, simulate.REFERENCE_RANDOM,
                                 simulate.REFERENCE_AFFINITY, strict=True):
        assert simulate.hit_rate(rnd, cfg, schedule, cap) == pytest.approx(ref_r, abs=0.01)
        assert simulate.hit_rate(mod, cfg, schedule, cap) == pytest.approx(ref_a, abs=0.01)


def test_cli_prints_the_reference_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--eps", "0.5", "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+([\d.]+ M) tokens\s+(\d+)% \[(\d+)%\]\s+(\d+)% \[(\d+)%\]$", out, re.M)
    assert [r[0] for r in rows] == ["0.5 M", "1 M", "2 M", "8 M"], out
    for _, got_r, ref_r, got_a, ref_a in rows:
        assert abs(int(got_r) - int(ref_r)) <= 1 and abs(int(got_a) - int(ref_a)) <= 1
    assert "bounded e=0.5" in out and "salted" in out
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["bounded_load_tradeoff.png", "hit_rate_by_policy.png", "owner_salting_cost.png"]
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in pngs)


def test_bounded_load_spills_more_and_balances_better_as_eps_shrinks() -> None:
    cfg = SimConfig(conversations=800)
    schedule = simulate.arrivals(cfg)
    tight, loose, none = (simulate.route(PolicySpec(Policy.BOUNDED, e), cfg, schedule) for e in (0.05, 1.0, 0.0))
    home = simulate.route(PolicySpec(Policy.CONSISTENT), cfg, schedule)
    assert tight.spill_rate > loose.spill_rate
    assert tight.spill_rate > 0.05
    assert tight.p99_max_over_avg < home.p99_max_over_avg
    assert none.p99_max_over_avg <= tight.p99_max_over_avg
    # Spilled turns lose cache hits; the unbounded ring never spills.
    cap = 2_000_000
    assert simulate.hit_rate(tight, cfg, schedule, cap) < simulate.hit_rate(home, cfg, schedule, cap)
    assert home.spills == 0


def test_salting_from_block_zero_costs_the_system_prompt() -> None:
    cfg = SimConfig(conversations=500)
    schedule = simulate.arrivals(cfg)
    home = simulate.route(PolicySpec(Policy.CONSISTENT), cfg, schedule)
    cap = 8_000_000  # everything fits: only first turns miss
    shared = simulate.hit_rate(home, cfg, schedule, cap)
    salted = simulate.hit_rate(home, cfg, schedule, cap, salted=True)
    # Per conversation: 8 prompts of 1,650 + 550k tokens; shared misses 150 a turn, salted also the first 1,500.
    total = sum(1650 + 550 * k for k in range(8))
    assert shared == pytest.approx(1 - 8 * 150 / total, abs=1e-9)
    assert salted == pytest.approx(1 - (8 * 150 + 1500) / total, abs=1e-9)
    grouped = SimConfig(conversations=500, conversations_per_owner=4)
    routed = simulate.route(PolicySpec(Policy.CONSISTENT), grouped, schedule)
    assert simulate.hit_rate(routed, grouped, schedule, cap, salted=True) >= salted
