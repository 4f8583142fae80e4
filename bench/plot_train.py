#!/usr/bin/env python3
"""Draws the load imbalance that moe_train prints, step by step, for several runs: the expert bias
at work against a run without it. One PNG.

    python3 bench/plot_balance.py --out docs/expert_bias_balance.png \
        "bias rate 1e-3=train_bias.txt" "no bias update=train_still.txt"
"""
import argparse
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(r"^step\s+(\d+)\s.*load max/mean ([0-9.]+) per expert, ([0-9.]+) per EP rank")


def read_log(path):
    steps, expert, rank = [], [], []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                steps.append(int(m.group(1)))
                expert.append(float(m.group(2)))
                rank.append(float(m.group(3)))
    if not steps:
        raise SystemExit(f"{path}: no 'step ... load max/mean' lines (a moe_train log?)")
    return steps, expert, rank


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="LABEL=LOG, a moe_train log each")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="moe_train: load imbalance of the first layer")
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in args.runs:
        label, sep, path = run.partition("=")
        if not sep:
            raise SystemExit(f"'{run}': expected LABEL=LOG")
        steps, expert, _ = read_log(path)
        ax.plot(steps, expert, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per expert, max / mean")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
