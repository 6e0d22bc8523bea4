"""The context sweep of `chatmesh capacity --contexts ... --plots DIR` as a PNG (capacity.py does the arithmetic).

Left: nodes against prompt length (log-log), the plan's count with each point marked by what binds (KV memory or
time), beside the time bound if the KV room held the full batch and the memory bound alone: where the plan leaves
the full-batch line, memory is what the extra nodes buy. Right: sequences per node, what fits in the KV room and
the batch held (capped by --max-batch): the 1 / context fall once memory binds.
"""

from __future__ import annotations

import typing
from pathlib import Path

from chatmesh.router.capacity import Binds, CapacityPlan

_MARK = {Binds.TIME: ("o", "#2b6a24"), Binds.KV_MEMORY: ("X", "#b3154f")}


def plot_sweep(plans: typing.Sequence[CapacityPlan], folder: Path) -> Path:
    """Writes nodes_by_context.png into `folder`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullLocator, StrMethodFormatter

    folder.mkdir(parents=True, exist_ok=True)
    xs = [p.workload.prompt_tokens for p in plans]
    first = plans[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    left.plot(xs, [p.nodes for p in plans], "-", color="#141413", label="nodes (the plan)")
    left.plot(xs, [p.nodes_at_full_batch for p in plans], "--", color="#b0420c",
              label=f"if the KV room held batch {first.hardware.max_batch}")
    left.plot(xs, [p.memory_nodes for p in plans], ":", color="#5f5e55", label="KV memory bound alone")
    for binds, (marker, color) in _MARK.items():
        pts = [(x, p.nodes) for x, p in zip(xs, plans) if p.binds is binds]
        if pts:
            left.scatter(*zip(*pts), marker=marker, s=70, color=color, zorder=3, label=f"{binds.value} binds")
    for x, p in zip(xs, plans):
        left.annotate(f"{p.nodes:,}", (x, p.nodes), textcoords="offset points", xytext=(6, -12), fontsize=8)
    left.set_ylabel("nodes")
    left.set_title("Nodes by context")
    right.plot(xs, [p.fit_per_node for p in plans], "--", marker="s", color="#b0420c", label="fit in KV room")
    right.plot(xs, [p.batch_per_node for p in plans], "-", marker="o", color="#141413", label="batch held")
    for x, p in zip(xs, plans):
        right.annotate(f"{p.batch_per_node:,}", (x, p.batch_per_node), textcoords="offset points", xytext=(6, -12),
                       fontsize=8)
    right.axhline(first.hardware.max_batch * first.replicas_per_node, color="#5f5e55", lw=0.8, ls=":",
                  label="--max-batch")
    right.set_ylabel("sequences per node")
    right.set_title("Concurrency by context (1 / context once memory binds)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(xs, [f"{x / 1000:g}k" for x in xs])
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    hw, wl = first.hardware, first.workload
    fig.suptitle(f"{first.model.params / 1e9:.1f} B {hw.precision.value.upper()} on {hw.gpu.name} TP={hw.tp}: "
                 f"{wl.conversations:,} conversations, a turn per {wl.turn_gap_s:g} s, {wl.output_tokens}-token "
                 f"replies, {wl.cached_share:.0%} cached")
    fig.tight_layout()
    path = folder / "nodes_by_context.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
