#!/usr/bin/env python3
"""Turns the CSV written by examples/finetune_mlp into docs/finetune.png: the training loss of
every mode (smoothed over 20 steps, raw values faint) and the stall time per step.

Usage: python3 docs/plot_finetune.py build/default/examples/finetune_mlp.csv [docs/finetune.png]
Needs matplotlib (pip install matplotlib).
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "finetune_mlp.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/finetune.png"
    steps, loss, stall = defaultdict(list), defaultdict(list), defaultdict(list)
    with open(src, newline="") as f:
        for row in csv.DictReader(f):
            m = row["mode"]
            steps[m].append(int(row["step"]))
            loss[m].append(float(row["loss"]))
            stall[m].append(float(row["stall_ms"]))
    if not steps:
        print(f"{src}: no rows", file=sys.stderr)
        return 1
    fig, (ax_loss, ax_stall) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1])
    for mode in steps:
        window = 20
        smooth = [sum(loss[mode][max(0, i - window + 1) : i + 1]) / len(loss[mode][max(0, i - window + 1) : i + 1])
                  for i in range(len(loss[mode]))]
        # dense and zero-offload are bit-identical by design: draw dense dashed on top so both show
        style = dict(linestyle="--", linewidth=2.4, zorder=3) if mode == "dense" else dict(linewidth=1.6)
        (line,) = ax_loss.plot(steps[mode], smooth, label=mode, **style)
        ax_loss.plot(steps[mode], loss[mode], color=line.get_color(), alpha=0.15, linewidth=0.6)
        ax_stall.plot(steps[mode], stall[mode], color=line.get_color(), linewidth=0.8, label=mode)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (cross-entropy)")
    ax_loss.set_title("3-layer MLP on UCI optical digits: dense vs ZeRO-Offload vs ZenFlow (host backend)")
    ax_loss.legend()
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_stall.set_ylabel("stall per step (ms)")
    ax_stall.set_xlabel("step")
    ax_stall.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
