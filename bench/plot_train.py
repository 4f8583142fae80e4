#!/usr/bin/env python3
"""Draws what moe_train prints, step by step, for several runs side by side: the first layer's load
imbalance (the expert bias at work against a run without it), the share of its slots dropped
(runs in capacity mode, moe_train --capacity-factor), or the loss (an FP8 run against a bf16 one,
with the relative gap of each run to the first drawn below). One PNG. Each run is its console log
or its --json file (a name ending in .json).

    python3 bench/plot_train.py --metric imbalance --out docs/expert_bias_balance.png \
        "bias rate 1e-3=train_bias.txt" "no bias update=train_still.txt"
    python3 bench/plot_train.py --metric loss --out docs/fp8_loss.png \
        "bf16=train_bf16.txt" "fp8=train_fp8.txt"
    python3 bench/plot_train.py --metric dropped --out dropped.png \
        "capacity 1.0=train_c1.json" "capacity 1.25=train_c125.json"
"""
import argparse
import os
import re

from headless_plots import image_file, label, number, pyplot, read_json, shown

# What each metric can be as the log holds it: a loss above 0 (drawn on a log scale), an
# imbalance max / mean of at least 0, a share dropped in [0, 1] in JSON ("dropped_fraction") and
# [0, 100] in a console log (a percentage). (least, most, above 0)
RANGES = {"loss": (None, None, True), "imbalance": (0.0, None, False),
          "dropped": (0.0, 100.0, False), "dropped_fraction": (0.0, 1.0, False)}
MOST_STEP = 2**53  # steps a float holds exactly

# A diverged run logs its loss as nan or inf: the line still holds the step's load.
LINE = re.compile(r"^step\s+(\d+)\s+loss ([-+]?(?:nan|inf)|[0-9.eE+-]+)\s.*load max/mean "
                  r"([0-9.]+) per expert, ([0-9.]+) per EP rank")
DROPPED = re.compile(r"^step\s+(\d+)\s.*per EP rank\s+([0-9.]+)% dropped")
JSON_KEYS = {"loss": "loss", "imbalance": "load_imbalance_expert", "dropped": "dropped_fraction"}


def metric_value(value, where, metric):
    """`value` (finite) within the metric's range, or an exit naming where it came from."""
    least, most, positive = RANGES[metric]
    return number(value, where, "plot_train.py", positive=positive, at_least=least, at_most=most)


def read_log(path, metric):
    steps, values = [], []
    if path.endswith(".json"):
        report = read_json(path, "plot_train.py")
        if not isinstance(report, dict) or not isinstance(report.get("log", []), list):
            raise SystemExit(f"plot_train.py: {path}: not a moe_train --json file")
        log = report.get("log", [])
        key = JSON_KEYS[metric]
        scale = 100.0 if metric == "dropped" else 1.0
        for i, entry in enumerate(log):
            where = f"{path}: log[{i}]"
            if not isinstance(entry, dict):
                raise SystemExit(f"plot_train.py: {where} is {entry!r}, not an object")
            if entry.get(key) is None:  # non-finite (JSON null), or no drops: a dropless run
                continue
            step = entry.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MOST_STEP:
                raise SystemExit(f"plot_train.py: {where}.step = {shown(step)} is not a step number")
            steps.append(step)
            values.append(scale * metric_value(entry[key], f"{where}.{key}",
                                               key if metric == "dropped" else metric))
        if not steps:
            raise SystemExit(f"{path}: no logged steps with {key} (a moe_train --json file"
                             f"{', in capacity mode' if metric == 'dropped' else ''}?)")
        return steps, values
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number_of_line, line in enumerate(f, start=1):
                m = (DROPPED if metric == "dropped" else LINE).match(line)
                if m:
                    group = 2 if metric in ("loss", "dropped") else 3
                    try:
                        value = float(m.group(group))
                    except ValueError:
                        raise SystemExit(f"plot_train.py: {path}:{number_of_line}: "
                                         f"{m.group(group)!r} is not a number")
                    where = f"{path}:{number_of_line}: {metric}"
                    if m.group(group).lstrip("+-") in ("nan", "inf"):
                        continue  # a diverged step's loss, as JSON's null (not a digit's overflow)
                    value = number(value, where, "plot_train.py")
                    # Its digits counted before int() reads them (Python refuses 4300 and more).
                    if len(m.group(1).lstrip("0")) > 16 or int(m.group(1)) > MOST_STEP:
                        raise SystemExit(f"plot_train.py: {path}:{number_of_line}: step "
                                         f"{m.group(1)[:12]}... is not a step number")
                    step = int(m.group(1))
                    steps.append(step)
                    values.append(metric_value(value, where, metric))
    except OSError as error:
        raise SystemExit(f"plot_train.py: {path}: {error}")
    if not steps:
        wanted = "'... % dropped'" if metric == "dropped" else "'step ... loss ... load max/mean'"
        raise SystemExit(f"{path}: no {wanted} lines (a moe_train log?)")
    return steps, values


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+",
                        help="LABEL=LOG, a moe_train log or --json file each")
    parser.add_argument("--out", required=True)
    parser.add_argument("--metric", choices=["imbalance", "dropped", "loss"], default="imbalance")
    parser.add_argument("--title")
    args = parser.parse_args()
    image_file(args.out, "plot_train.py")  # before a long run's logs are read
    runs = []
    for run in args.runs:
        run_label, sep, path = run.partition("=")
        if not sep:
            raise SystemExit(f"plot_train.py: '{run}': expected LABEL=LOG")
        runs.append((run_label, *read_log(path, args.metric)))
    plt = pyplot("plot_train.py")
    runs = [(label(name), steps, values) for name, steps, values in runs]
    title = label(args.title) if args.title else None

    if args.metric in ("imbalance", "dropped"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, steps, values in runs:
            ax.plot(steps, values, label=name)
        if args.metric == "imbalance":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
            ax.set_ylabel("tokens per expert, max / mean")
            ax.set_title(title or "moe_train: load imbalance of the first layer")
        else:
            ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
            ax.set_ylabel("slots dropped, %")
            ax.set_title(title or "moe_train: slots the first layer dropped")
        ax.legend()
        bottom = ax
    else:
        fig, (ax, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})
        for name, steps, values in runs:
            ax.plot(steps, values, label=name)
        ax.set_yscale("log")
        ax.set_ylabel("loss")
        ax.set_title(title or "moe_train: loss")
        ax.legend()
        base_label, base_steps, base_values = runs[0]
        base = dict(zip(base_steps, base_values))
        for name, steps, values in runs[1:]:
            shared = [(s, v) for s, v in zip(steps, values) if s in base]
            bottom.plot([s for s, _ in shared], [100 * (v / base[s] - 1) for s, v in shared],
                        label=f"{name} against {base_label}")
        bottom.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
        bottom.set_ylabel("loss gap, %")
        bottom.legend()
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
