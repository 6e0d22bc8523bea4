"""`chatmesh capacity` reproduces the reference's Part 1 figures, and the arithmetic generalises: the batch is
what fits in KV room, a context sweep, the host tier, and a disaggregated plan (issue 31)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from chatmesh.mesh.cli import main
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.router import capacity, disaggregate, link

REFERENCE_FIGURES = [
    "160 KiB", "20 KiB per GPU", "8.8 GB", "63.2 GB", "3.08 M", "133,333", "1,000,000", "200,000",
    "12.7 ms", "79 tok/s", "20,098 tok/s", "44,850 tok/s", "11.1", "20 (160 GPUs)", "1,698 sequences", "5.1 s",
    "4,864 batch slots", "58.6 M tokens vs 56.3 M free",
]


# What `chatmesh capacity` printed before issue 31, line for line: at the reference's defaults these stay.
BEFORE_ISSUE_31 = """\
capacity plan: 70.6 B parameters (80 layers, 8 KV heads, head dim 128), FP8, H100 SXM, TP=8, 8 GPUs per node
  KV cache per token        160 KiB (20 KiB per GPU)
  weights per GPU           8.8 GB; KV room 63.2 GB
  KV tokens per node        3.08 M
  turns per second          333
  output tokens/s           133,333
  prompt tokens/s           1,000,000; uncached 200,000 at 80% cached
  decode step at batch 256  12.7 ms = 79 tok/s per stream
  per node                  decode 20,098 tok/s, prefill 44,850 tok/s
  busy node-equivalents     11.1 (decode 6.6, prefill 4.5 = 40%)
  nodes                     20 (160 GPUs) at 60% target + 1 spare
  in flight (Little)        1,698 sequences = 333/s x 5.1 s, against 4,864 batch slots
  idle history              58.6 M tokens vs 56.3 M free KV fleet-wide (does not fit)
"""

H100, H200 = capacity.GPUS["h100"], capacity.GPUS["h200"]


def _at(prompt: int, **hardware: object) -> capacity.CapacityPlan:
    return capacity.plan(hardware=dataclasses.replace(capacity.Hardware(), **hardware),  # type: ignore[arg-type]
                         workload=dataclasses.replace(capacity.Workload(), prompt_tokens=prompt))


def test_defaults_print_the_reference_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    missing = [f for f in REFERENCE_FIGURES if f not in out]
    assert not missing, out
    lines = out.splitlines()
    changed = [line for line in BEFORE_ISSUE_31.splitlines() if line not in lines]
    assert not changed, out
    assert [line for line in lines if line in BEFORE_ISSUE_31.splitlines()] == BEFORE_ISSUE_31.splitlines()
    assert "binds                     time: 20 nodes by busy time at batch 256" in out


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


# ---- issue 31: memory binds before time does --------------------------------------------------------------

def test_32k_prompts_hold_the_batch_to_what_fits_in_kv_room() -> None:
    p = _at(32_000)
    ctx = 32_000 + 400 / 2
    room = 80e9 - 70.6e9 / 8 - 8e9  # 63.175 GB per GPU
    kv_gpu = 2 * 80 * 8 * 128 * 1 / 8  # 20,480 bytes
    assert p.fit_per_replica == math.floor(room / (ctx * kv_gpu)) == 95
    assert p.batch == 95 and p.kv_limited and p.binds is capacity.Binds.KV_MEMORY
    step = (70.6e9 / 8 + 95 * ctx * kv_gpu) / (3.35e12 * 0.6)
    assert p.decode_step_s == pytest.approx(step, rel=1e-12)
    assert p.decode_step_s * 1e3 == pytest.approx(35.56, abs=0.01)  # not the 88.4 ms of an impossible batch 256
    assert p.nodes >= p.memory_nodes and p.nodes >= p.time_nodes
    assert p.in_flight == pytest.approx(20_000 / 60 * 400 * step)
    assert p.memory_nodes == math.ceil(p.in_flight / (95 * 0.6)) + 1 == 85
    assert p.time_nodes == 164 and p.nodes_at_full_batch == 157  # memory costs 7 nodes at this context
    assert p.batch_slots == (p.nodes - 1) * 95
    out = capacity.render(p)
    assert "decode step at batch 95   35.6 ms = 28 tok/s per stream" in out
    assert "95 fit at 32,200 tokens" in out and "168.8 GB of KV per GPU, room 63.2 GB: batch 95" in out
    assert "157 if the full batch fit (+7 for memory)" in out


@pytest.mark.parametrize("precision, gpu, fit, step_ms", [
    # FP8 on H100: 63.175e9 / (32,200 x 20,480) = 95.8; step (8.825e9 + 95 x 32,200 x 20,480) / 2.01e12
    (capacity.Precision.FP8, H100, 95, 35.559),
    # BF16 on H100: room 80 - 17.65 - 8 = 54.35 GB; 54.35e9 / (32,200 x 40,960) = 41.2;
    # step (17.65e9 + 41 x 32,200 x 40,960) / 2.01e12
    (capacity.Precision.BF16, H100, 41, 35.684),
    # BF16 on H200: (141 - 17.65 - 8) e9 / (32,200 x 40,960) = 87.4; step (17.65e9 + 87 x 32,200 x 40,960) / 2.88e12
    (capacity.Precision.BF16, H200, 87, 45.971),
])
def test_kv_limited_batch_by_hand(precision: capacity.Precision, gpu: capacity.Gpu, fit: int,
                                  step_ms: float) -> None:
    p = _at(32_000, precision=precision, gpu=gpu)
    assert p.fit_per_replica == fit and p.batch == fit
    assert p.decode_step_s * 1e3 == pytest.approx(step_ms, abs=0.001)
    assert p.decode_tokens_per_s_node == pytest.approx(fit / p.decode_step_s)


def test_bf16_fits_half_the_sequences_of_fp8_at_long_context() -> None:
    fp8, bf16 = _at(128_000), _at(128_000, precision=capacity.Precision.BF16)
    assert fp8.fit_per_replica == 24  # 3.08 M tokens / 128,200
    assert bf16.fit_per_replica == 10  # 54.35 GB / (128,200 x 40 KiB): weights take more room too


def test_sweep_concurrency_falls_as_one_over_context_once_memory_binds() -> None:
    plans = capacity.sweep([capacity.parse_tokens(c) for c in "4k,8k,16k,32k,128k".split(",")])
    by = {p.workload.prompt_tokens: p for p in plans}
    assert [p.batch for p in plans] == [256, 256, 190, 95, 24]
    assert [p.binds for p in plans] == [capacity.Binds.TIME] * 2 + [capacity.Binds.KV_MEMORY] * 3
    for short, long in ((16_000, 128_000), (4_000, 32_000)):  # 8x longer: 8x fewer fit, within rounding
        a, b = by[short], by[long]
        ratio = b.mean_context_tokens / a.mean_context_tokens
        assert a.fit_per_node / b.fit_per_node == pytest.approx(ratio, rel=1 / b.fit_per_node)
    assert by[16_000].batch / by[128_000].batch == pytest.approx(8, abs=0.1)
    # once memory binds every step reads the whole KV room: the step stops depending on context
    assert by[32_000].decode_step_s == pytest.approx(by[128_000].decode_step_s, rel=0.01)
    assert all(p.nodes >= p.memory_nodes for p in plans)
    assert [p.nodes for p in plans] == sorted(p.nodes for p in plans)


def test_parse_tokens() -> None:
    assert [capacity.parse_tokens(t) for t in ("4k", "32K", "128000", " 1.5k", "16,000")] == \
        [4000, 32_000, 128_000, 1500, 16_000]
    for bad in ("", "k", "lots", "-4k", "0", "nan", "infk"):
        with pytest.raises(InvalidArgument):
            capacity.parse_tokens(bad)


def test_a_sequence_that_fits_nowhere_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="one sequence of 4,000,200 tokens"):
        _at(4_000_000)


def test_host_tier_at_the_reference() -> None:
    p = capacity.plan()
    h = p.host
    assert h.host_tokens_per_node == pytest.approx(1536 * 2**30 / 163_840)  # 10.07 M
    assert h.warm_share_hbm == pytest.approx(p.free_kv_tokens / p.idle_history_tokens)  # 96%: "barely fits"
    assert h.warm_share == 1.0 and h.idle_fits  # "turns barely fits into fits"
    needed = (p.idle_history_tokens - p.free_kv_tokens) / 20 * 163_840
    assert h.host_bytes_needed_node == pytest.approx(needed) and needed / 2**30 == pytest.approx(17.6, abs=0.1)
    assert h.reload_tokens == 2_400 and h.reload_bytes_gpu == 2_400 * 20_480
    assert h.prefill_s == pytest.approx(600 / 44_850, rel=1e-3)
    # to hide the reload under the turn's own prefill: cached / uncached x prefill rate x KV per GPU
    assert h.reload_bytes_s_needed_gpu == pytest.approx(4 * p.prefill_tokens_per_s_node * 20_480)
    assert h.reload_s == pytest.approx(2_400 * 20_480 / 50e9) and h.reload_s < h.prefill_s < h.recompute_s
    small = capacity.plan(hardware=dataclasses.replace(capacity.Hardware(), host_memory_bytes=1 * 2**30))
    assert small.host.warm_share < 1.0 and not small.host.idle_fits
    out = capacity.render(p)
    assert "warm: 96% in HBM alone, 100% with the host tier" in out
    assert "18 GiB per node would make the idle history fit" in out and "needs 3.7 GB/s per GPU" in out


@pytest.mark.parametrize("prompt", [3_000, 4_000, 32_000])
def test_the_host_memory_it_names_makes_the_idle_history_fit(prompt: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Taken at its word: the GiB per node the plan names, given back as --host-memory-gib, keep every idle
    conversation warm, and a GiB less is not printed as 100% (4k needs 42.2 GiB, 32k 128.5: rounding to nearest
    named too little)."""
    def host_lines(gib: int | None) -> str:
        extra = [] if gib is None else ["--host-memory-gib", str(gib)]
        assert main(["capacity", "--prompt-tokens", str(prompt), *extra]) == 0
        return "\n".join(line for line in capsys.readouterr().out.splitlines() if "GiB per node" in line)

    named = int(host_lines(None).split("\n")[1].split()[0])
    assert "100% with the host tier" in host_lines(named)
    short = host_lines(named - 1)
    assert "100% with the host tier" not in short and "99." in short
    h = capacity.plan(workload=dataclasses.replace(capacity.Workload(), prompt_tokens=prompt)).host
    assert named - 1 < h.host_bytes_needed_node / 2**30 <= named
    assert capacity.share_text(0.9989) == "99.8%" and capacity.share_text(0.001) == "0.1%"
    assert capacity.share_text(1.0) == "100%" and capacity.share_text(0.72) == "72%"


def test_disaggregated_plan() -> None:
    for p in (capacity.plan(), _at(32_000), capacity.plan(workload=dataclasses.replace(
            capacity.Workload(), cached_share=0.5))):
        d = disaggregate.disaggregate(p)
        assert d.transfer_bytes_s == pytest.approx(p.uncached_tokens_per_s * p.kv_bytes_per_token)
        assert d.saved_nodes == 0  # busy time adds up the same in this roofline
        assert d.nodes >= p.time_nodes - d.saved_nodes
        assert d.prefill_nodes == math.ceil(p.prefill_busy_nodes / 0.6) + 1
        assert d.decode_nodes == max(math.ceil(p.decode_busy_nodes / 0.6) + 1, p.memory_nodes)
        assert d.peak_bytes_s_prefill_node == pytest.approx(p.prefill_tokens_per_s_node * p.kv_bytes_per_token)
        assert d.decode_itl_s < d.aggregated_itl_s
    d = disaggregate.disaggregate(capacity.plan())
    assert (d.prefill_nodes, d.decode_nodes) == (9, 13)
    assert d.transfer_bytes_s == pytest.approx(200_000 * 163_840)  # 32.8 GB/s
    assert d.link_share_prefill_node == pytest.approx(44_850 * 163_840 / 400e9, rel=1e-3)
    assert d.turn_transfer_s == pytest.approx(link.DEFAULT_LATENCY_S + 600 * 163_840 / 400e9)  # link.py's model
    long = disaggregate.disaggregate(_at(32_000))
    assert long.decode_binds is capacity.Binds.KV_MEMORY and long.decode_nodes == long.decode_memory_nodes


def test_cli_sweep_plot_and_disaggregate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--contexts", "4k,32k", "--disaggregate", "--plots", str(tmp_path),
                 "--link-nics", "1", "--host-memory-gib", "512"]) == 0
    out = capsys.readouterr().out
    assert "context sweep" in out and "KV memory" in out and "disaggregated" in out and "of 400 Gb/s" in out
    assert "512 GiB per node" in out
    png = tmp_path / "nodes_by_context.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["capacity", "--contexts", "4k,lots"]) == 2
    assert "not a token count" in capsys.readouterr().err
    assert main(["capacity", "--plots", str(tmp_path)]) == 2
    assert "--contexts" in capsys.readouterr().err


def _printed(args: list[str], capsys: pytest.CaptureFixture[str]) -> set[str]:
    assert main(["capacity", *args]) == 0
    return set(capsys.readouterr().out.splitlines())


def test_the_docs_show_what_the_tool_prints(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    printed = (_printed([], capsys) | _printed(["--prompt-tokens", "4000"], capsys)
               | _printed(["--prompt-tokens", "32000", "--disaggregate"], capsys)
               | _printed(["--contexts", "4k,8k,16k,32k,64k,128k"], capsys))
    for page in (root / "docs" / "capacity" / "README.md", root / "README.md"):
        blocks = page.read_text().split("```")[1::2]
        shown = [line for block in blocks if "tok/s" in block and "pip install" not in block
                 for line in block.splitlines()[1:] if line.strip()]
        stale = [line for line in shown if line.startswith("  ") and line not in printed]
        assert shown and not stale, f"{page}: regenerate with chatmesh capacity: {stale}"
