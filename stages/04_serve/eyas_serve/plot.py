"""bench.png: acceptance per draft position; output tokens/s against concurrency with and without the draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas_common.contract import write_png_atomic


def plot_results(results: dict[str, Any], png: Path) -> Path:
    from matplotlib.figure import Figure  # drawn off-screen, with no pyplot state: no display needed

    fig = Figure(figsize=(11, 4))
    ax_pos, ax_tps = fig.subplots(1, 2)
    spec = results.get("spec") or {}
    per_pos = [p for p in spec.get("per_position") or [] if p is not None]
    if per_pos:
        ax_pos.bar(range(1, len(per_pos) + 1), per_pos, color="tab:blue")
        ax_pos.set_xticks(range(1, len(per_pos) + 1))
        title = f"acceptance length {spec['acceptance_length']:.2f}"
    else:
        ax_pos.text(0.5, 0.5, "no per-position counters", ha="center", va="center", transform=ax_pos.transAxes)
        title = "acceptance: not reported by the server"
    ax_pos.set(xlabel="draft position", ylabel="accepted / verification steps", ylim=(0, 1), title=title)
    levels = results["levels"]
    conc = [lv["concurrency"] for lv in levels]
    ax_tps.plot(conc, [lv["draft"]["tokens_per_s"] for lv in levels], "o-", label="with draft")
    if all(lv.get("baseline") for lv in levels):
        ax_tps.plot(conc, [lv["baseline"]["tokens_per_s"] for lv in levels], "s--", label="baseline (no draft)")
    ax_tps.set(xlabel="requests in flight", ylabel="output tokens/s", xscale="log", title="throughput")
    ax_tps.set_xticks(conc, [str(c) for c in conc])
    for ax in (ax_pos, ax_tps):
        ax.grid(alpha=0.3)
    ax_tps.legend()
    fig.tight_layout()
    return write_png_atomic(png, fig)


def plot_compare(compare: dict[str, Any], png: Path) -> Path:
    """compare.png: tokens per target step of each way of serving; speedup against concurrency."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax_step, ax_speed = fig.subplots(1, 2)
    rows = compare["rows"]
    labels = [r["label"] for r in rows]
    ax_step.barh(labels, [r["tokens_per_step"] or 0 for r in rows], color="tab:blue")
    ax_step.set(xlabel="tokens per target step", title="what each verification step yields")
    conc = compare["concurrency"]
    for r in rows:
        ax_speed.plot(conc, [r["speedup"].get(str(c)) or float("nan") for c in conc], "o-", label=r["label"])
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set(xlabel="requests in flight", ylabel="speedup over the target alone", xscale="log",
                 title=f"recommended: {compare['recommendation']['label']}")
    ax_speed.set_xticks(conc, [str(c) for c in conc])
    ax_speed.legend(fontsize=8)
    for ax in (ax_step, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return write_png_atomic(png, fig)
