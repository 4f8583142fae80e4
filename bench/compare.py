#!/usr/bin/env python3
"""Joins a C++ benchmark's JSON with the PyTorch peer's on shape name and prints the ratio table,
or with --summary one line per benchmark for the gpu-check summary.

    python3 bench/compare.py [--summary] ours.json peer.json
"""
import argparse
import json
import sys


def read_results(path, role):
    """A benchmark's JSON (its `results` each with a name and total_us), or an exit naming it."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {role} '{path}': {error}")
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, list) or not all(
            isinstance(r, dict) and "name" in r and r.get("total_us", 0) > 0 for r in results):
        sys.exit(f"error: {role} '{path}' is no benchmark's JSON (results, each with a name and a "
                 "positive total_us)")
    return report


def rows(ours, peer):
    peer_by_name = {r["name"]: r for r in peer["results"]}
    for r in ours["results"]:
        p = peer_by_name.get(r["name"])
        peer_us = p["total_us"] if p else float("nan")
        floor = r.get("fraction_of_floor", r.get("fraction_of_dense"))
        yield r, peer_us, floor, r.get("back_to_back_fraction_of_same_size_copy")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--summary", action="store_true")
    parser.add_argument("ours")
    parser.add_argument("peer")
    args = parser.parse_args()
    ours, peer = read_results(args.ours, "ours"), read_results(args.peer, "peer")
    if not {r["name"] for r in ours["results"]} & {r["name"] for r in peer["results"]}:
        sys.exit(f"error: '{args.ours}' and '{args.peer}' share no shape name")
    if args.summary:
        parts = []
        for r, peer_us, floor, sized in rows(ours, peer):
            text = f"{100 * floor:.0f}% {peer_us / r['total_us']:.1f}x" if floor is not None else \
                f"{peer_us / r['total_us']:.1f}x"
            extras = []
            if sized is not None:  # against copies of the stage's own size, back to back
                extras.append(f"sized {100 * sized:.0f}%")
            ceiling = r.get("two_passes_fraction_of_floor")
            if ceiling is not None:  # the floor fraction that bare passes of these bytes reach
                extras.append(f"two-pass ceiling {100 * ceiling:.0f}%")
            if extras:
                text += f" ({', '.join(extras)})"
            parts.append(text)
        print("; ".join(parts))
        return
    print(f"{ours.get('bench', args.ours)} on {ours.get('device', 'an unnamed device')}: ours vs "
          f"{peer.get('peer', 'peer')}")
    print(f"{'shape':<48} {'ours us':>9} {'peer us':>9} {'speedup':>8} {'floor%':>7}")
    for r, peer_us, floor, _ in rows(ours, peer):
        floor_text = f"{100 * floor:6.0f}%" if floor is not None else "      -"
        print(f"{r['name']:<48} {r['total_us']:9.1f} {peer_us:9.1f} {peer_us / r['total_us']:7.1f}x {floor_text}")


if __name__ == "__main__":
    main()
