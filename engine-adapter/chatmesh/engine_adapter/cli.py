"""`chatmesh engine roofline`: the sim presets' step model, as the reference's capacity figures."""

from __future__ import annotations

import argparse
from typing import Any

from chatmesh.engine_adapter.roofline import PRESETS


def register(sub: Any) -> None:
    p = sub.add_parser("engine", help="engine replica tools")
    p.add_argument("action", choices=("roofline",))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="one preset (default: all)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=3200)
    p.set_defaults(handler=_roofline)


def _roofline(args: argparse.Namespace) -> int:
    for name in [args.preset] if args.preset else sorted(PRESETS):
        node = PRESETS[name]
        step = node.memory_s(args.batch * args.context)
        print(f"{name}: TP {node.plan.hardware.tp}, KV {node.kv_bytes_per_token / 1024:.0f} KiB/token/GPU, "
              f"{node.kv_tokens / 1e6:.2f} M tokens of KV per node, host tier {node.host_kv_tokens / 1e6:.1f} M")
        print(f"  decode step at batch {args.batch} x {args.context} tokens: {step * 1e3:.1f} ms "
              f"({1 / step:.0f} tokens/s per stream, {args.batch / step:,.0f} per node)")
        print(f"  prefill {node.prefill_tokens_per_s:,.0f} tokens/s; a 512-token chunk adds "
              f"{512 / node.prefill_tokens_per_s * 1e3:.1f} ms; 16,000 tokens in one step "
              f"{node.step_s(16_000, 16_000) * 1e3:.0f} ms")
    return 0
