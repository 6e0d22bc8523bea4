"""`chatmesh simulate` reproduces the reference's hit-rate table within one point, and its extensions behave:
the ring's bound trades hit rate for balance, salting costs the system prompt, following the KV keeps most
of affinity's hit rate at the balance of a tight bound, and with pulls a moved turn keeps its history."""

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
    for cap, ref_r, ref_a in zip(simulate.REFERENCE_CACHES, simulate.REFERENCE_RANDOM,
                                 simulate.REFERENCE_AFFINITY, strict=True):
        assert simulate.simulate(PolicySpec(Policy.RANDOM), cfg, schedule, cap).hit_rate == pytest.approx(
            ref_r, abs=0.01)
        assert simulate.simulate(PolicySpec(Policy.MODULO), cfg, schedule, cap).hit_rate == pytest.approx(
            ref_a, abs=0.01)


def test_cli_prints_the_reference_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--eps", "0.5", "--pulls", "off", "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+([\d.]+ M) tokens\s+(\d+)% \[(\d+)%\]\s+(\d+)% \[(\d+)%\]$", out, re.M)
    assert [r[0] for r in rows] == ["0.5 M", "1 M", "2 M", "8 M"], out
    for _, got_r, ref_r, got_a, ref_a in rows:
        assert abs(int(got_r) - int(ref_r)) <= 1 and abs(int(got_a) - int(ref_a)) <= 1
    assert "bounded e=0.5" in out and "follow e=0.2" in out and "salted" in out
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["bounded_load_tradeoff.png", "hit_rate_by_policy.png", "hit_rate_vs_load.png",
                    "owner_salting_cost.png"]
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in pngs)


def test_cli_refuses_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--policies", "consistent,psychic", "--caches", "2"]) == 2
    assert "unknown policies psychic" in capsys.readouterr().err


def test_bounded_load_spills_more_and_balances_better_as_eps_shrinks() -> None:
    cfg = SimConfig(conversations=800)
    schedule = simulate.arrivals(cfg)
    cap = 2_000_000
    tight, loose, none = (simulate.simulate(PolicySpec(Policy.BOUNDED, e), cfg, schedule, cap)
                          for e in (0.05, 1.0, 0.0))
    home = simulate.simulate(PolicySpec(Policy.CONSISTENT), cfg, schedule, cap)
    assert tight.spill_rate > loose.spill_rate
    assert tight.spill_rate > 0.05
    assert tight.p99_max_over_avg < home.p99_max_over_avg
    assert none.p99_max_over_avg <= tight.p99_max_over_avg
    # Spilled turns lose cache hits; the unbounded ring never spills.
    assert tight.hit_rate < home.hit_rate
    assert home.spills == 0


def test_salting_from_block_zero_costs_the_system_prompt() -> None:
    cfg = SimConfig(conversations=500)
    schedule = simulate.arrivals(cfg)
    cap = 8_000_000  # everything fits: only first turns miss
    home = simulate.simulate(PolicySpec(Policy.CONSISTENT), cfg, schedule, cap)
    # Per conversation: 8 prompts of 1,650 + 550k tokens; shared misses 150 a turn, salted also the first 1,500.
    total = sum(1650 + 550 * k for k in range(8))
    assert home.hit_rate == pytest.approx(1 - 8 * 150 / total, abs=1e-9)
    assert home.salted_hit_rate == pytest.approx(1 - (8 * 150 + 1500) / total, abs=1e-9)
    grouped = SimConfig(conversations=500, conversations_per_owner=4)
    routed = simulate.simulate(PolicySpec(Policy.CONSISTENT), grouped, schedule, cap)
    assert routed.salted_hit_rate >= home.salted_hit_rate


def test_following_the_kv_keeps_affinitys_hit_rate_at_a_tight_bounds_balance() -> None:
    """The issue's small-scale check: the reference's density (500 conversations and 2 M tokens per replica) on
    4 replicas. Follow's hit rate is within 0.5 point of unbounded consistent hashing, with a p99 max/avg load no
    higher than the ring's bound at eps 0.25 (which pays ~3 points for that balance)."""
    cfg = SimConfig(conversations=2000, replicas=4)
    schedule = simulate.arrivals(cfg)
    cap = 2_000_000
    ring = simulate.simulate(PolicySpec(Policy.CONSISTENT), cfg, schedule, cap)
    tight = simulate.simulate(PolicySpec(Policy.BOUNDED, 0.25), cfg, schedule, cap)
    kv = simulate.simulate(PolicySpec(Policy.FOLLOW, 0.2), cfg, schedule, cap)
    assert kv.hit_rate >= ring.hit_rate - 0.005
    assert kv.p99_max_over_avg <= tight.p99_max_over_avg
    assert kv.hit_rate > tight.hit_rate + 0.02
    assert 0.12 < kv.placed / kv.turns < 0.16  # about the first turns (1 in 8), a few evicted ones besides


def test_follow_learns_evictions_from_the_engines_reports() -> None:
    """With caches too small to keep the working set, the router hears which prefixes were evicted and places
    those turns by load (nothing left to lose) instead of treating them as spills; without reports it cannot."""
    cfg = SimConfig(conversations=800, replicas=4)
    schedule = simulate.arrivals(cfg)
    cap = 200_000  # ~54 average histories per replica for 200 conversations each
    told = simulate.simulate(PolicySpec(Policy.FOLLOW, 0.2), cfg, schedule, cap)
    deaf = simulate.simulate(PolicySpec(Policy.FOLLOW, 0.2), SimConfig(conversations=800, replicas=4,
                                                                         report_interval_s=1e9), schedule, cap)
    first_turns = cfg.conversations
    assert told.placed > 2 * first_turns and deaf.placed == first_turns
    assert told.hit_rate >= deaf.hit_rate - 0.002  # a lost prefix costs the same wherever the turn goes


def test_with_pulls_a_tight_bound_keeps_affinitys_hit_rate() -> None:
    """Issue 29 at small scale (the reference's density on 4 replicas): with pulls, follow at its tight pull bound
    serves as many prompt tokens without prefill as unbounded consistent hashing, at the balance of the ring's
    tightest bound, which without pulls pays ~18 points for it; every token is cached, pulled or prefilled once,
    and the pulls use a sliver of the link."""
    cfg = SimConfig(conversations=2000, replicas=4)
    schedule = simulate.arrivals(cfg)
    cap = 2_000_000
    ring = simulate.simulate(PolicySpec(Policy.CONSISTENT), cfg, schedule, cap)
    tight = simulate.simulate(PolicySpec(Policy.BOUNDED, 0.05), cfg, schedule, cap)
    pulled = simulate.simulate(PolicySpec(Policy.FOLLOW, 0.2, pull=True, pull_eps=0.05), cfg, schedule, cap)
    assert pulled.served_rate >= ring.served_rate - 0.001
    assert pulled.p99_max_over_avg <= tight.p99_max_over_avg + 0.01
    assert tight.served_rate < ring.served_rate - 0.1
    assert pulled.pulled_rate > 0.03 and pulled.pulls > 0.05 * pulled.turns
    assert pulled.hit_rate + pulled.pulled_rate + pulled.prefilled_rate == pytest.approx(1.0)
    assert pulled.pulled_bytes == pytest.approx(pulled.pulled_rate * sum(
        1650 + 550 * a.turn for a in schedule) * cfg.cost.kv_bytes_per_token, rel=1e-9)
    assert 0 < pulled.link_mean_share < pulled.link_peak_share < 0.1
    # the same schedule through the ring's tight bound with pulls: the history follows it too, at more pulls
    ring_pulled = simulate.simulate(PolicySpec(Policy.BOUNDED, 0.05, pull=True), cfg, schedule, cap)
    assert ring_pulled.served_rate > tight.served_rate + 0.1 and ring_pulled.pulls > pulled.pulls


def test_cli_with_pulls_prints_where_prompt_tokens_come_from(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    assert main(["simulate", "--conversations", "400", "--replicas", "4", "--caches", "2", "--eps", "0.05",
                 "--policies", "consistent,bounded,follow", "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "follow e=0.2 " in out and "follow e=0.05 +pull" in out and "bounded e=0.05 +pull" in out
    table = out.split("prompt tokens by source")[1]
    row = re.search(r"^\s+follow e=0.05 \+pull\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%", table, re.M)
    assert row is not None, out
    assert sum(float(x) for x in row.groups()) == pytest.approx(100.0, abs=0.2)
    assert "3,200 Gb/s" in table and "MB/s per replica" in table
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "bounded_load_tradeoff.png", "hit_rate_vs_load.png", "owner_salting_cost.png", "prompt_tokens_by_source.png"]
