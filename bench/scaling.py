#!/usr/bin/env python3
"""Weak scaling of the layer over expert parallelism: moe_bench at one config with EP = 1, 2, 4, 8
(as many as the machine has GPUs), the same tokens per GPU, one run each under mpirun. Prints the
per-stage times, the dispatch and combine bandwidth over the link, and the weak-scaling
efficiency (time at EP = 1 over time at EP = n); writes every number to one JSON.

    python3 bench/scaling.py [--config configs/deepseek-v3.yaml] [--build build] [--out DIR]
"""
import argparse
import json
import os
import subprocess
import sys

from launch import ROOT, count_in, mpirun, output_folder, read_report, require_built, require_mpirun

EXCHANGES = ["moe dispatch", "moe combine", "moe combine backward", "moe dispatch backward"]


def gpu_count(build):
    result = subprocess.run([os.path.join(build, "tests", "moe_gpu_count")], capture_output=True,
                            text=True)
    return int(result.stdout.strip() or 0) if result.stdout.strip().isdigit() else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "deepseek-v3.yaml"))
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--iters", type=count_in(1, 100000), default=20)
    parser.add_argument("--out", default="scaling")
    args = parser.parse_args()
    if not os.path.isfile(args.config):
        sys.exit(f"error: --config '{args.config}' is not a file")
    require_built(args.build, os.path.join("apps", "moe_bench"), os.path.join("tests", "moe_gpu_count"))
    require_mpirun()
    gpus = gpu_count(args.build)
    if gpus == 0:
        sys.exit("error: no CUDA GPU on this machine; the runs need at least one")
    output_folder(args.out)
    runs = []
    ep = 1
    while ep <= gpus:
        path = os.path.join(args.out, f"ep{ep}.json")
        command = [os.path.join(args.build, "apps", "moe_bench"), "--config", args.config,
                   "--ep", str(ep), "--iters", str(args.iters), "--json", path]
        print(f"== EP {ep}", flush=True)
        try:
            code, text = mpirun(ep, command, 300)
        except subprocess.TimeoutExpired:
            code, text = -1, "timed out after 300 s"
        if code != 0 or not os.path.exists(path):
            print("\n".join(text.splitlines()[-15:]), file=sys.stderr)
        else:
            report = read_report(path, ("total_ms", "TFLOPs_per_gpu", "link_floor_ms", "p2p_GBps",
                                        "ep", "tokens_per_gpu"), ("stages_ms",))
            if isinstance(report, str):
                print(f"EP {ep} failed: {report}", file=sys.stderr)
            else:
                runs.append(report)
        ep *= 2
    if not runs:
        sys.exit("no run succeeded")

    base = runs[0]["total_ms"]
    print(f"\n{runs[0]['config']}, {runs[0]['tokens_per_gpu']} tokens per GPU, {runs[0].get('device', '')}")
    stages = list(runs[0]["stages_ms"])
    print(f"{'stage (ms)':<26}" + "".join(f"{'EP ' + str(r['ep']):>10}" for r in runs))
    for stage in stages:
        print(f"{stage:<26}" + "".join(f"{r['stages_ms'].get(stage, 0.0):10.3f}" for r in runs))
    print(f"{'forward + backward':<26}" + "".join(f"{r['total_ms']:10.3f}" for r in runs))
    print(f"{'weak-scaling efficiency':<26}" + "".join(f"{100 * base / r['total_ms']:9.0f}%" for r in runs))
    print(f"{'TFLOP/s per GPU':<26}" + "".join(f"{r['TFLOPs_per_gpu']:10.0f}" for r in runs))
    for r in runs:
        if r["ep"] == 1:
            continue
        # Rows leaving a rank per exchange (uniform routing): link_floor_ms covers four exchanges.
        link_bytes = r["link_floor_ms"] * 1e-3 * r["p2p_GBps"] * 1e9 / 4
        rates = [link_bytes / (r["stages_ms"][s] * 1e-3) / 1e9 for s in EXCHANGES if s in r["stages_ms"]]
        print(f"EP {r['ep']}: {link_bytes / 1e6:.0f} MB over the link per exchange; stage bandwidth "
              + ", ".join(f"{s.replace('moe ', '')} {v:.0f} GB/s" for s, v in zip(EXCHANGES, rates))
              + f" (p2p {r['p2p_GBps']:.0f} GB/s; stages include permute and chunk sort)")
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
