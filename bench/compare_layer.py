#!/usr/bin/env python3
"""The whole layer, ours against PyTorch, on the same configs and meshes in one run: moe_bench and
bench/peer_layer.py (torchtitan style) under mpirun, one rank per GPU, the peer both eager and
through torch.compile. The ratio is against the faster of the two, the strongest peer this run
builds. Prints the ratio table and writes every number to one JSON that bench/plot.py draws.

    python3 bench/compare_layer.py [--build build] [--configs mixtral-8x7b qwen3-30b-a3b ...]
                                   [--ranks 1 2] [--tokens 1024 8192] [--out DIR]

Both sides keep bf16 weight gradients (moe_bench --grad-dtype bf16), as autograd does for bf16
weights, so that the memory columns compare like with like.
"""
import argparse
import json
import os
import subprocess
import sys

from launch import (ROOT, config_name, count_in, mpirun, output_folder, read_report,
                    refuse_repeats, require_built, require_mpirun)


# What the table reads of each side's report.
OURS_NUMBERS = ("total_ms", "fraction_of_dense", "memory_bytes", "dense_TFLOPs")
PEER_NUMBERS = ("total_ms", "memory_bytes")


def run_one(kind, ranks, command, path, numbers):
    try:
        code, text = mpirun(ranks, command, 300)
    except subprocess.TimeoutExpired:
        code, text = -1, "timed out after 300 s"
    if code != 0 or not os.path.exists(path):
        print(f"  {kind} failed ({code}):\n" + "\n".join(text.splitlines()[-15:]), file=sys.stderr)
        return None
    report = read_report(path, numbers)
    if isinstance(report, str):
        print(f"  {kind} failed: {report}", file=sys.stderr)
        return None
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"),
                        help="the build folder holding apps/moe_bench")
    parser.add_argument("--configs", nargs="+", type=config_name,
                        default=["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"],
                        help="config names in configs/")
    parser.add_argument("--ranks", nargs="+", type=count_in(1, 4096), default=[1, 2],
                        help="GPUs of each run, one rank each (counts above this machine's skipped)")
    parser.add_argument("--tokens", nargs="+", type=count_in(1, 1 << 30), default=None,
                        help="tokens per GPU, each a run of its own (default: each config's)")
    parser.add_argument("--iters", type=count_in(1, 100000), default=20,
                        help="timed steps of each side")
    parser.add_argument("--out", default="layer-compare",
                        help="folder of the JSON results (layer_compare.json and each run's)")
    args = parser.parse_args()
    refuse_repeats(parser, "--configs", args.configs)
    refuse_repeats(parser, "--ranks", args.ranks)
    refuse_repeats(parser, "--tokens", args.tokens)
    require_built(args.build, os.path.join("apps", "moe_bench"))
    require_mpirun()
    try:
        import torch  # only to count the GPUs here; the runs are separate processes
    except ImportError as error:
        sys.exit(f"error: the peer needs PyTorch ({error})")
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("error: no CUDA GPU on this machine; the comparison runs on GPUs")
    ranks_here = [r for r in args.ranks if r <= gpus]
    if not ranks_here:
        sys.exit(f"error: --ranks {' '.join(map(str, args.ranks))}: this machine has {gpus} GPU(s)")
    output_folder(args.out)
    rows = []
    failed = 0
    for name in args.configs:
        config = os.path.join(ROOT, "configs", name + ".yaml")
        for tokens in args.tokens or [None]:
            # Each side's --tokens where asked for; the files of a token count named after it.
            tokens_flag = ["--tokens", str(tokens)] if tokens else []
            suffix = f"_T{tokens}" if tokens else ""
            for ranks in ranks_here:
                print(f"== {name}, {ranks} GPU(s)" + (f", T = {tokens} per GPU" if tokens else ""),
                      flush=True)
                ours_path = os.path.join(args.out, f"ours_{name}_{ranks}{suffix}.json")
                peer_path = os.path.join(args.out, f"peer_{name}_{ranks}{suffix}.json")
                ours = run_one("moe_bench", ranks,
                               [os.path.join(args.build, "apps", "moe_bench"), "--config", config,
                                "--grad-dtype", "bf16", "--iters", str(args.iters), "--json",
                                ours_path] + tokens_flag, ours_path, OURS_NUMBERS)
                peer_command = [sys.executable, os.path.join(ROOT, "bench", "peer_layer.py"),
                                "--config", config, "--iters", str(args.iters)] + tokens_flag
                peer = run_one("peer_layer.py", ranks, peer_command + ["--json", peer_path],
                               peer_path, PEER_NUMBERS)
                compiled_path = os.path.join(args.out, f"peer_compiled_{name}_{ranks}{suffix}.json")
                compiled = run_one("peer_layer.py --compile", ranks,
                                   peer_command + ["--compile", "--json", compiled_path],
                                   compiled_path, PEER_NUMBERS)
                rows.append({"config": name, "ranks": ranks, "tokens": tokens, "ours": ours,
                             "peer": peer, "peer_compiled": compiled})
                failed += ours is None or (peer is None and compiled is None)

    print("\nours GiB: device memory the layer took (cudaMemGetInfo, once the mesh's NCCL communicators "
          "had connected: their buffers, mesh GiB, serve every layer and the trainer, and PyTorch's allocator "
          "statistics do not count NCCL's either); torch GiB: peak allocated with "
          "gradients freed before each step; kept: with gradients kept across steps; reserved: peak the "
          "caching allocator held; dense%: of the dense GEMM rate under sustained load (TFLOP/s, and the "
          "rate of a short burst, in the last columns); compiled ms: the peer through torch.compile; "
          "ratio: ours against the faster peer; at floor: the ratio a layer at our roofline floor "
          "(moe_bench's step floor) would reach against it")
    print(f"\n{'config':<16} {'GPUs':>4} {'T':>6} {'ours ms':>9} {'torch ms':>9} {'compiled':>9} {'ratio':>6} "
          f"{'at floor':>8} {'dense%':>7} "
          f"{'ours GiB':>9} {'torch GiB':>9} {'kept':>9} {'reserved':>9} {'dense':>6} {'burst':>6} {'mesh GiB':>9}")
    for r in rows:
        o, p = r["ours"], r["peer"]
        ours_ms = o["total_ms"] if o else float("nan")
        c = r.get("peer_compiled")
        eager_ms = p["total_ms"] if p else float("nan")
        compiled_ms = c["total_ms"] if c else float("nan")
        # The strongest peer: the faster of the two that ran (nan only if neither did).
        peer_ms = min((t for t in (eager_ms, compiled_ms) if t == t), default=float("nan"))
        dense = 100 * o["fraction_of_dense"] if o else float("nan")
        floor_ms = o.get("step_floor_ms", float("nan")) if o else float("nan")
        ours_gib = o["memory_bytes"] / 2**30 if o else float("nan")
        peer_gib = p["memory_bytes"] / 2**30 if p else float("nan")
        peer_reserved = p.get("memory_reserved_bytes", float("nan")) / 2**30 if p else float("nan")
        peer_kept = p.get("memory_grads_kept_bytes", float("nan")) / 2**30 if p else float("nan")
        mesh_gib = o.get("mesh_memory_bytes", float("nan")) / 2**30 if o else float("nan")
        dense_rate = o["dense_TFLOPs"] if o else float("nan")
        burst_rate = o.get("dense_TFLOPs_burst", float("nan")) if o else float("nan")
        tokens = o.get("tokens_per_gpu", r["tokens"]) if o else r["tokens"]
        print(f"{r['config']:<16} {r['ranks']:>4} {tokens if tokens else '-':>6} {ours_ms:9.3f} {eager_ms:9.3f} {compiled_ms:9.3f} "
              f"{ours_ms / peer_ms:5.2f}x {floor_ms / peer_ms:7.2f}x "
              f"{dense:6.0f}% {ours_gib:9.2f} {peer_gib:9.2f} {peer_kept:9.2f} {peer_reserved:9.2f} "
              f"{dense_rate:6.0f} {burst_rate:6.0f} {mesh_gib:9.2f}")
    with open(os.path.join(args.out, "layer_compare.json"), "w") as f:
        json.dump(rows, f, indent=2)
    if failed:
        sys.exit(f"error: {failed} of {len(rows)} comparisons lack our run or both peers' "
                 "(their output is above)")


if __name__ == "__main__":
    main()
