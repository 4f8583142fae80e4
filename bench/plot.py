#!/usr/bin/env python3
"""Draws bench/compare_layer.py's results: our per-stage times beside PyTorch's total for each
config and mesh, and the time ratio. PNGs into the output folder (docs/ by default).

    python3 bench/plot.py layer-compare/layer_compare.json [--out docs]
"""
import argparse
import os

from headless_plots import image_file, label, number, pyplot, read_json, writable_folder

# Results a plot draws legibly; compare_layer.py writes a few a run.
MOST_ROWS = 60
# A step time beyond any benchmark's (a day), or below any (a microsecond), which would only
# overflow the ratios.
MOST_MS = 864e5
LEAST_MS = 1e-3
# The images, in the --out folder.
IMAGES = ("layer_stages.png", "layer_vs_pytorch.png")


def peer_ms(row):
    """The strongest peer's step: the faster of the eager and the compiled PyTorch layer."""
    times = [p["total_ms"] for p in (row.get("peer"), row.get("peer_compiled")) if p]
    return min(times)


def check_row(row, where):
    """Exits naming the row and field unless a row holds what the plots read: its config and
    ranks, and each side that ran (ours, peer, peer_compiled; null where it failed) with a step
    time above 0, ours with its stages' times."""
    if not isinstance(row.get("config"), str) or isinstance(row.get("ranks"), bool) or \
            not isinstance(row.get("ranks"), int) or not 1 <= row["ranks"] <= 2**20:
        raise SystemExit(f"plot.py: {where}: needs 'config' (a name) and 'ranks' (a count), got "
                         f"{row.get('config')!r} and {row.get('ranks')!r}")
    for side in ("ours", "peer", "peer_compiled"):
        run = row.get(side)
        if run is None:
            continue
        if not isinstance(run, dict):
            raise SystemExit(f"plot.py: {where}: '{side}' is {run!r}, not a run's results")
        number(run.get("total_ms"), f"{where}: {side}.total_ms", "plot.py", positive=True,
               at_least=LEAST_MS, at_most=MOST_MS)
    stages = (row.get("ours") or {}).get("stages_ms", {}) if row.get("ours") else {}
    if row.get("ours") and "stages_ms" not in row["ours"]:
        raise SystemExit(f"plot.py: {where}: ours has no stages_ms (a moe_bench --json file's)")
    if not isinstance(stages, dict):
        raise SystemExit(f"plot.py: {where}: ours.stages_ms is {stages!r}, not stage times")
    for name, ms in stages.items():
        number(ms, f"{where}: ours.stages_ms[{name!r}]", "plot.py", at_least=0, at_most=MOST_MS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="compare_layer.py's JSON")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "docs"))
    args = parser.parse_args()
    writable_folder(args.out, "plot.py")
    for image in IMAGES:  # each a file to write, not a folder in its place
        image_file(os.path.join(args.out, image), "plot.py")
    results = read_json(args.results, "plot.py")
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise SystemExit(f"plot.py: {args.results}: not compare_layer.py's list of results")
    for i, r in enumerate(results):
        check_row(r, f"{args.results}: row {i}")
    rows = [r for r in results if r.get("ours") and (r.get("peer") or r.get("peer_compiled"))]
    if not rows:
        raise SystemExit(f"plot.py: {args.results}: no result with both our layer and PyTorch's")
    if len(rows) > MOST_ROWS:
        raise SystemExit(f"plot.py: {args.results}: {len(rows)} results to draw; a plot holds at "
                         f"most {MOST_ROWS} legibly")
    plt = pyplot("plot.py")
    # A run over several token counts (compare_layer.py --tokens) names each bar's.
    token_counts = [r["ours"].get("tokens_per_gpu", "?") for r in rows]
    several = len(set(map(str, token_counts))) > 1
    labels = [f"{label(r['config'])}\n{r['ranks']} GPU" + (f", T={label(t)}" if several else "")
              for r, t in zip(rows, token_counts)]
    stages = []
    for r in rows:
        for name in r["ours"]["stages_ms"]:
            if name not in stages:
                stages.append(name)
    device = label(rows[0]["ours"].get("device", "")) if rows else ""

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 5))
    width = 0.38
    positions = range(len(rows))
    bottom = [0.0] * len(rows)
    colors = plt.cm.tab20.colors
    for i, stage in enumerate(stages):
        values = [r["ours"]["stages_ms"].get(stage, 0.0) for r in rows]
        ax.bar([p - width / 2 for p in positions], values, width, bottom=bottom, color=colors[i % 20],
               label=label(stage.replace("moe ", "")))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([p + width / 2 for p in positions], [peer_ms(r) for r in rows], width, color="0.6",
           label="PyTorch, the faster of eager and compiled (total)")
    ax.set_xticks(list(positions), labels)
    ax.set_ylabel("forward + backward, ms")
    ax.set_xlabel("our stages, each timed with the host queued ahead: their sum is near our step time,"
                  " not equal to it", fontsize=8)
    ax.set_title(f"moe-runtime stages (left) and the PyTorch layer (right), bf16, {device}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, IMAGES[0]), dpi=120)

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    ratios = [r["ours"]["total_ms"] / peer_ms(r) for r in rows]
    ax.bar(list(positions), ratios, color="tab:blue")
    ax.axhline(1.0, color="0.3", linewidth=1)
    for p, v in zip(positions, ratios):
        ax.text(p, v + 0.02, f"{v:.2f}x", ha="center")
    ax.set_xticks(list(positions), labels)
    ax.set_ylabel("our step / the faster PyTorch step\n(eager or compiled; lower is better)")
    tokens = "T per GPU as labelled" if several else f"T = {label(token_counts[0])} per GPU"
    ax.set_title(f"Whole layer, forward + backward, bf16, {tokens}, {device}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, IMAGES[1]), dpi=120)
    print("wrote", os.path.join(args.out, "layer_stages.png"), "and layer_vs_pytorch.png")


if __name__ == "__main__":
    main()
