"""The training curves of a draft run (train_log.jsonl) as a PNG: loss, and top-1 accuracy per TTT step on
the training batches and on the validation slice."""

from __future__ import annotations

from pathlib import Path

from eyas_common.contract import iter_jsonl, write_png_atomic


def plot_log(log: Path, png: Path) -> Path:
    from matplotlib.figure import Figure  # drawn off-screen, with no pyplot state: no display needed

    everything = [r for _, r in iter_jsonl(log)]
    records = [r for r in everything if "loss" in r]  # training records; validation ones have val_* keys
    vals = [r for r in everything if "val_step_acc" in r]
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], color="black", label="weighted total")
    n_steps = len(records[0]["step_acc"]) if records else 0
    for k in range(n_steps):
        ax_loss.plot(steps, [r["step_loss"][k] for r in records], lw=0.8, alpha=0.7, label=f"step {k}")
        line, = ax_acc.plot(steps, [r["step_acc"][k] for r in records], lw=1.0, label=f"step {k}")
        if vals:
            ax_acc.plot([r["step"] for r in vals], [r["val_step_acc"][k] for r in vals], ls="--", marker=".",
                        color=line.get_color(), lw=0.8)
    ax_loss.set(xlabel="optimiser step", ylabel="soft cross-entropy", title="loss", yscale="log")
    ax_acc.set(xlabel="optimiser step", ylabel="top-1 = target argmax", title="accuracy per TTT step (dashed: validation)", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if records:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return write_png_atomic(png, fig)
