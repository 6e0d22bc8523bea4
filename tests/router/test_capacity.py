"""`chatmesh capacity` reproduces the reference's Part 1 figures, and the arithmetic generalises."""

from __future__ import annotations

import dataclasses

import pytest

from chatmesh.mesh.cli import main
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.router import capacity

REFERENCE_FIGURES = [
    "160 KiB", "20 KiB per GPU", "8.8 GB", "63.2 GB", "3.08 M", "133,333", "1,000,000", "200,000",
    "12.7 ms", "79 tok/s", "20,098 tok/s", "44,850 tok/s", "11.1", "20 (160 GPUs)", "1,698 sequences", "5.1 s",
    "4,864 batch slots", "58.6 M tokens vs 56.3 M free",
]


def test_defaults_print_the_reference_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    missing = [f for f in REFERENCE_FIGURES if f not in out]
    assert not missing, out


def test_plan_values() -> None:
    p = capacity.plan()
    assert p.kv_bytes_per_token == 163_840
    assert p.kv_tokens_per_node == pytest.approx(3.086e6, rel=1e-3)
    assert p.decode_step_s == pytest.approx(0.01274, rel=1e-3)
    assert p.nodes == 20 and p.gpus == 160
    assert p.prefill_share == pytest.approx(0.40, abs=0.01)
    assert not p.idle_history_fits


def test_bf16_doubles_kv_and_halves_tokens_per_node() -> None:
    fp8 = capacity.plan()
    bf16 = capacity.plan(hardware=dataclasses.replace(capacity.Hardware(), precision=capacity.Precision.BF16,
                                                      gpu=capacity.GPUS["h200"]))
    assert bf16.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token
    assert bf16.weights_bytes_gpu == pytest.approx(2 * fp8.weights_bytes_gpu)
    assert bf16.prefill_tokens_per_s_node == pytest.approx(fp8.prefill_tokens_per_s_node / 2)


def test_tp4_puts_two_replicas_on_a_node() -> None:
    p = capacity.plan(hardware=dataclasses.replace(capacity.Hardware(), tp=4))
    assert p.replicas_per_node == 2
    assert p.kv_bytes_per_token_gpu == 163_840 / 4


def test_cli_overrides_and_turn_gap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--turn-gap-s", "20", "--bandwidth-tbs", "4.8", "--hbm-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "turns per second          1,000" in out and "4.8 TB/s" in out


def test_model_that_does_not_fit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgument):
        capacity.plan(hardware=dataclasses.replace(capacity.Hardware(), tp=1, precision=capacity.Precision.BF16))
    assert main(["capacity", "--tp", "3"]) == 2
    assert "must divide" in capsys.readouterr().err
