#!/usr/bin/env python3
"""Predicts the MoE layer's step time on an expert-parallel mesh from a config, as docs/design.md
("Cost model") derives it: the expert GEMMs at a GEMM rate, and the four token exchanges of a
step (dispatch, combine, and their backward mirrors) over NVLink inside a node and InfiniBand
between nodes, with and without overlapping the exchange with the GEMMs.

    python3 scripts/cost_model.py configs/deepseek-v3.yaml [--tokens 8192] [--imbalance 1.2]
        [--gpus-per-node 8] [--nvlink-gbs 330] [--ib-gbs 50] [--gemm-tflops 780]
        [--half-rate-rows 164] [--exchange-efficiency 1.0] [--ep 1 2 4 8 ... 256]

The rates default to what docs/performance.md measured on H200s of one host: NVLink p2p ~330 GB/s
per GPU, and expert GEMMs that reach 780 TFLOP/s × rows / (rows + 164) at `rows` rows per expert
(fitted to deepseek-v3's weak-scaling run at EP 1 and 8); InfiniBand at 50 GB/s per GPU.
--exchange-efficiency is the share of the link rate an exchange reaches: 1 for the peer exchange,
about 0.6 for the NCCL one (the same run).
"""
import argparse
import sys


def read_config(path):
    """The flat `key: value` YAML of configs/ (comments and blank lines skipped)."""
    config = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition(":")
            if not sep:
                sys.exit(f"{path}:{number}: expected 'key: value', got '{line}'")
            config[key.strip()] = value.strip()
    for key in ("hidden", "ffn_hidden", "num_experts", "topk"):
        if key not in config:
            sys.exit(f"{path}: '{key}' is missing")
    return config


def predict(config, tokens, ep, args):
    """Per-GPU times (ms) of one forward + backward at `tokens` tokens per GPU."""
    H = int(config["hidden"])
    F = int(config["ffn_hidden"])
    K = int(config["topk"])
    E = int(config["num_experts"])
    if E % ep:
        return None
    row_bytes = H * (4 if config.get("dtype", "bf16") == "fp32" else 2)
    # Expert GEMMs: forward h = X·w13ᵀ (2F·H per row) and Y = a·w2ᵀ (H·F), 2 FLOPs per multiply-add;
    # the backward twice the forward. Each GPU computes the rows its experts receive: T·K on
    # average, imbalance × that on the most loaded GPU, which the step waits for.
    flops = 2 * 3 * H * F * tokens * K * 3 * args.imbalance
    # The products are as fast as their row counts allow: few rows per expert leave the GPU's
    # SMs and the weight gradients' inner dimension short. Each of a GPU's E/EP experts gets
    # T·K·EP/E rows on average.
    rows = tokens * K * ep / E * args.imbalance
    rate = args.gemm_tflops * rows / (rows + args.half_rate_rows)
    gemm_ms = flops / (rate * 1e12) * 1e3
    # The gate (forward and both backward products, 6·T·E·H FLOPs) at the full rate.
    gemm_ms += 6 * tokens * E * H / (args.gemm_tflops * 1e12) * 1e3
    # Each exchange moves every slot's row once; a slot stays on this GPU with probability 1/EP,
    # stays in the node with (gpn - 1)/EP more, and crosses nodes otherwise (uniform routing).
    gpn = min(args.gpus_per_node, ep)
    slots = tokens * K * args.imbalance
    intra = slots * (gpn - 1) / ep * row_bytes
    inter = slots * (ep - gpn) / ep * row_bytes
    # NVLink and InfiniBand run side by side: an exchange takes as long as its slower share.
    exchange_ms = max(intra / (args.nvlink_gbs * 1e9), inter / (args.ib_gbs * 1e9)) * 1e3
    exchange_ms /= args.exchange_efficiency
    exchanges_ms = 4 * exchange_ms
    serial = gemm_ms + exchanges_ms
    # Overlap hides each exchange under the GEMMs of the other chunks, except the first dispatch
    # chunk and the last combine chunk of each direction (1/chunks of each exchange).
    exposed = exchanges_ms / args.chunks
    # (never slower than running them in turn: where the exchange dominates, chunks gain nothing)
    overlapped = min(serial, max(gemm_ms, exchanges_ms) + exposed)
    return {
        "ep": ep,
        "nodes": (ep + args.gpus_per_node - 1) // args.gpus_per_node,
        "bytes_mb": 4 * (intra + inter) / 1e6,
        "gemm_ms": gemm_ms,
        "exchange_ms": exchanges_ms,
        "serial_ms": serial,
        "overlap_ms": overlapped,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: the config's)")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="max/mean rows per GPU (1 = perfectly balanced)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbs", type=float, default=330.0, help="NVLink GB/s per GPU")
    parser.add_argument("--ib-gbs", type=float, default=50.0, help="InfiniBand GB/s per GPU")
    parser.add_argument("--gemm-tflops", type=float, default=780.0,
                        help="the expert GEMMs' rate with many rows per expert")
    parser.add_argument("--half-rate-rows", type=float, default=164.0,
                        help="rows per expert at which the expert GEMMs reach half that rate")
    parser.add_argument("--exchange-efficiency", type=float, default=1.0,
                        help="share of the link rate an exchange reaches (NCCL ~0.6, peer ~1)")
    parser.add_argument("--chunks", type=int, default=4, help="exchange chunks when overlapped")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    args = parser.parse_args()
    for name in ("imbalance", "nvlink_gbs", "ib_gbs", "gemm_tflops", "exchange_efficiency"):
        if getattr(args, name) <= 0:
            sys.exit(f"--{name.replace('_', '-')} = {getattr(args, name)} must be positive")
    if args.imbalance < 1:
        sys.exit(f"--imbalance = {args.imbalance} must be >= 1 (max over mean)")
    if args.half_rate_rows < 0 or args.exchange_efficiency > 1:
        sys.exit("--half-rate-rows must be >= 0 and --exchange-efficiency at most 1")
    if args.gpus_per_node < 1 or args.chunks < 1 or min(args.ep) < 1:
        sys.exit("--gpus-per-node, --chunks and every --ep must be >= 1")
    config = read_config(args.config)
    tokens = args.tokens or int(config.get("tokens", 8192))
    print(f"{args.config}: T = {tokens} per GPU, imbalance {args.imbalance}, NVLink "
          f"{args.nvlink_gbs:g} GB/s, IB {args.ib_gbs:g} GB/s (exchanges at "
          f"{args.exchange_efficiency:.0%} of them), GEMM {args.gemm_tflops:g} TFLOP/s at "
          f"rows / (rows + {args.half_rate_rows:g}), {args.gpus_per_node} GPUs a node")
    print(f"{'EP':>5} {'nodes':>5} {'MB/GPU':>9} {'GEMM ms':>9} {'exch ms':>9} {'serial ms':>10} "
          f"{'overlap ms':>11} {'hidden':>7}")
    for ep in args.ep:
        p = predict(config, tokens, ep, args)
        if p is None:
            print(f"{ep:>5}  EP does not divide the {config['num_experts']} experts")
            continue
        hidden = 1 - (p["overlap_ms"] - p["gemm_ms"]) / p["exchange_ms"] if p["exchange_ms"] else 1
        print(f"{p['ep']:>5} {p['nodes']:>5} {p['bytes_mb']:>9.1f} {p['gemm_ms']:>9.3f} "
              f"{p['exchange_ms']:>9.3f} {p['serial_ms']:>10.3f} {p['overlap_ms']:>11.3f} "
              f"{max(hidden, 0):>6.0%}")


if __name__ == "__main__":
    main()
