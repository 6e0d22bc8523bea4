"""The llama-cpp-python baseline's bookkeeping (no llama.cpp needed): serving orders and TTFT from arrival."""

from __future__ import annotations

from bench.llamacpp_baseline import Served, arrival_ttfts, serve_order


def test_round_robin_takes_turn_k_of_every_conversation_before_turn_k_plus_1() -> None:
    assert serve_order("rr", 3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert serve_order("nocache", 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_conversation_order_finishes_one_conversation_first() -> None:
    assert serve_order("conv", 2, 3) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def _served(c: int, turn: int, start: float, first: float, end: float) -> Served:
    return Served(c, turn, 100, 10, start, first, end, 90, 1.0, 9, 1.0)


def test_ttft_from_arrival_counts_the_wait_behind_other_conversations() -> None:
    # a one-at-a-time server, round-robin over two conversations, each request served for 1 s with TTFT 0.25 s
    served = [_served(0, 0, 10.0, 10.25, 11.0), _served(1, 0, 11.0, 11.25, 12.0),
              _served(0, 1, 12.0, 12.25, 13.0), _served(1, 1, 13.0, 13.25, 14.0)]
    ttft = arrival_ttfts(served)
    assert ttft[(0, 0)] == 0.25  # arrived at the start, served at once
    assert ttft[(1, 0)] == 1.25  # arrived at the start, waited for conversation 0's turn 1
    assert ttft[(0, 1)] == 1.25  # arrived when its turn 1 ended (11.0), waited for conversation 1's turn 1
    assert ttft[(1, 1)] == 1.25  # arrived at 12.0
