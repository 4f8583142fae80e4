#!/usr/bin/env python3
"""Joins a C++ benchmark's JSON with the PyTorch peer's on shape name and prints the ratio table.

    python3 bench/compare.py ours.json peer.json
"""
import json
import sys


def main():
    ours, peer = (json.load(open(path)) for path in sys.argv[1:3])
    peer_by_name = {r["name"]: r for r in peer["results"]}
    print(f"{ours['bench']} on {ours['device']}: ours vs {peer.get('peer', 'peer')}")
    print(f"{'shape':<48} {'ours us':>9} {'peer us':>9} {'speedup':>8} {'floor%':>7}")
    for r in ours["results"]:
        p = peer_by_name.get(r["name"])
        peer_us = p["total_us"] if p else float("nan")
        floor = r.get("fraction_of_floor", r.get("fraction_of_dense"))
        floor_text = f"{100 * floor:6.0f}%" if floor is not None else "      -"
        print(f"{r['name']:<48} {r['total_us']:9.1f} {peer_us:9.1f} {peer_us / r['total_us']:7.1f}x {floor_text}")


if __name__ == "__main__":
    main()
