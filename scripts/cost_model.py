#!/usr/bin/env python3
"""Predicts the MoE layer's step time on an expert-parallel mesh from a config, as docs/design.md
("Cost model") derives it: the expert GEMMs at a GEMM rate, and the four token exchanges of a
step (dispatch, combine, and their backward mirrors) over NVLink inside a node and InfiniBand
between nodes, with and without overlapping the exchange with the GEMMs.

    python3 scripts/cost_model.py configs/deepseek-v3.yaml [--tokens 8192] [--imbalance 1.2]
        [--gpus-per-node 8] [--nvlink-gbs 330] [--ib-gbs 50] [--gemm-tflops 770]
        [--dense-tflops 715] [--half-rate-inner 380] [--copy-gbs 4190] [--grad-bytes 4] [--fixed-ms 0.3]
        [--transport peer|nccl|copy] [--exchange-efficiency E] [--chunks C] [--fp8-dispatch]
        [--fp8 [--fp8-speedup 1.3] [--micro-batches N]]
        [--capacity-factor F [--pad-to-capacity]] [--ep 1 2 4 8 ... 256]

The rates default to what docs/performance.md measured on H200s of one host: NVLink p2p ~330 GB/s
per GPU, HBM copies at 4190 GB/s, and expert products that reach min(770 TFLOP/s × k / (k + 380),
715 TFLOP/s) at inner dimension k (fitted to the expert stages of deepseek-v3 at EP 1 to 8,
mixtral-8x7b and qwen3-30b-a3b at EP 1 and 4; a dense 8192³ product sustains 660–700 there);
InfiniBand at 50 GB/s per GPU. --exchange-efficiency is the share of the link rate an exchange
reaches: 1 for the peer exchange, about 0.6 for the NCCL one (the same run), about 0.65
for the copy exchange (0.57 and 0.73 at EP 2 on 2 × H200, deepseek-v3 and qwen3-30b-a3b).
--chunks is the NCCL or copy exchange's pipeline; by default the config's exchange_chunks, else
the layer's automatic count at each EP (MoEConfig::effective_exchange_chunks). The peer exchange
does not pipeline. --transport defaults to the config's ep_transport, and auto (its default)
prices the exchange the layer's auto picks: peer inside one node of at most 8 GPUs, NCCL beyond.
An EP the transport cannot run (peer past 8 GPUs or one node, copy past one node) and an
--imbalance above the EP (the busiest of EP GPUs holds at most EP times the mean) are named in
their row, which gets no prediction.
--capacity-factor (or the config's capacity_factor) prices capacity mode: an expert takes at most
C = ceil(F · T · K / E) rows (at most T, rounded up to align_size) from each rank. With
--pad-to-capacity (or pad_to_capacity: true) every expert computes its EP · C rows, and under EP
each rank sends its E · C rows (its zero rows too) over NCCL, whatever the imbalance; without it
the capacity caps the busiest GPU's rows, an imbalance of at most E · C / (T · K).
--fp8-dispatch prices the exchanges toward the experts as E4M3 rows with an fp32 scale per 128
values, H + 4 · ceil(H / 128) bytes a row: the forward's dispatch of x (and the peer exchange's
second one) and the backward's of dy, as DeepSeek-V3 trained; the exchanges back from the experts
(the combine's y, the backward's dx) carry bf16 rows.
--fp8 prices the FP8 experts: their four data products (h, y, dA, dX) run --fp8-speedup times the
bf16 products' rate at the same shape (1.3 fits the layer's steps measured on H200s, where a
dense 8192³ product gains 1.6), the weight gradients stay bf16, and two passes at the copy rate
join them: the rows' quantization (X, a, dY and dh read as bf16 and written as E4M3; on one EP
rank the permute writes X's and dY's codes, and under --fp8-dispatch the receiver's sort, one byte
a value) and the weights' (each read once and written twice), the latter once in --micro-batches
steps. The
layer's fp8_dispatch comes with fp8: price it as --fp8 --fp8-dispatch.
"""
import argparse
import math
import os
import re
import signal
import sys


# Every key the layer's config loader reads (core/config_file.cpp); any other is refused there.
LAYER_KEYS = frozenset((
    "hidden", "ffn_hidden", "num_experts", "topk", "score_function", "pre_softmax", "num_groups",
    "group_topk", "max_nodes_per_token", "ep_ranks_per_node", "scaling_factor", "expert_bias",
    "aux_loss_coeff", "z_loss_coeff", "align_size", "capacity_factor", "drop_policy",
    "pad_to_capacity", "shared_ffn_hidden", "shared_gate", "shared_expert_overlap", "fp8",
    "fp8_dispatch", "dtype", "grad_dtype", "keep_expert_input", "activation_chunk_mib",
    "gemm_workspace_mib", "gemm_autotune", "ep", "dp", "ep_transport", "exchange_chunks", "tokens"))


# A decimal integer as the layer's loader takes one: a sign at most, no leading zero ('+16' is
# 16; '016' would be octal to yaml-cpp, and is refused there as here).
DECIMAL = r"[-+]?(0|[1-9][0-9]*)"


def read_config(path):
    """The flat `key: value` YAML of configs/ (comments and blank lines skipped), with the
    numbers the model reads checked as the layer's config loader checks them, and a key the
    layer does not read refused."""
    config = {}
    if not os.path.exists(path):
        sys.exit(f"{path}: no such file")
    if not os.path.isfile(path):  # a device or a pipe would be read without end
        sys.exit(f"{path}: not a regular file; a config is a YAML file")
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no part of a key
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        sys.exit(f"{path}: cannot be read as a config: {error}")
    for number, line in enumerate(lines, 1):
        # A comment opens a line or follows a blank: '16#c' is a value to YAML, which the layer
        # refuses as no integer.
        line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        if not line:
            continue
        if line == "---" and not config:  # a document marker may open the document
            continue
        if line == "...":  # and one may close it
            break
        if line[0] in "{[-":
            sys.exit(f"{path}:{number}: a flow mapping, a list or a second document: this model "
                     f"reads the configs' one 'key: value' a line, got '{line}'")
        key, sep, value = line.partition(":")
        # YAML's mapping wants a blank after the colon: 'hidden:64' is one string to the layer.
        if not sep or (value and not value[0].isspace()):
            sys.exit(f"{path}:{number}: expected 'key: value', got '{line}'")
        key = key.strip()
        if len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"":  # a quoted key
            key = key[1:-1]
        if key not in LAYER_KEYS:
            sys.exit(f"{path}:{number}: unknown key '{key}' (the layer's keys: "
                     f"{', '.join(sorted(LAYER_KEYS))})")
        if key in config:
            sys.exit(f"{path}:{number}: '{key}' appears twice")
        config[key] = value.strip()
    for key in ("hidden", "ffn_hidden", "num_experts", "topk"):
        if key not in config:
            sys.exit(f"{path}: '{key}' is missing")
    # The layer's own bounds (docs/design.md, "Configuration").
    for key, low, high in (("hidden", 1, 2**20), ("ffn_hidden", 1, 2**20),
                           ("num_experts", 1, 2048), ("topk", 1, 16), ("tokens", 0, 2**30),
                           ("shared_ffn_hidden", 0, 2**20), ("align_size", 0, 4096)):
        if key in config:
            text = config[key]
            if not re.fullmatch(DECIMAL, text):
                sys.exit(f"{path}: {key} = '{text}' is not a decimal integer")
            if not low <= int(text) <= high:
                sys.exit(f"{path}: {key} = {text} must be in [{low}, {high}]")
    # The keys the model does not price are checked for their kind as the loader reads them
    # (its rules across keys, such as num_groups with group_topk, are the layer's own: a config
    # that passes here may still be refused there, as `floor_table --config` shows).
    for key, low, high in (("num_groups", 0, 2048), ("group_topk", 0, 2048),
                           ("max_nodes_per_token", 0, 2048), ("ep_ranks_per_node", 0, 2**20),
                           ("gemm_workspace_mib", 0, 2**20),
                           ("ep", 1, 2**20), ("dp", 1, 2**20), ("exchange_chunks", 0, 1024)):
        if key in config:
            text = config[key]
            if not re.fullmatch(DECIMAL, text) or not low <= int(text) <= high:
                sys.exit(f"{path}: {key} = '{text}' is not a decimal integer in [{low}, {high}]")
    # Reals as YAML writes them (no '1_0', which Python's float() would take), within the
    # layer's bounds.
    for key, low, high in (("scaling_factor", 1e-6, 1e6), ("aux_loss_coeff", 0, 1e6),
                           ("z_loss_coeff", 0, 1e6), ("capacity_factor", 0, math.inf),
                           ("activation_chunk_mib", 0, 2**20)):
        if key in config:
            text = config[key]
            real = re.fullmatch(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?", text)
            value = float(text) if real else math.nan
            if not math.isfinite(value) or not low <= value <= high:
                sys.exit(f"{path}: {key} = '{text}' is not a finite number in [{low:g}, {high:g}]")
    if "capacity_factor" in config and float(config["capacity_factor"]) == 0:
        sys.exit(f"{path}: capacity_factor = 0 must be positive (omit the key for dropless "
                 "routing)")
    if float(config.get("capacity_factor", "0")) > 1e4:
        sys.exit(f"{path}: capacity_factor = {config['capacity_factor']} is past 10000")
    true_false = ("true", "false")
    for key, allowed in (("dtype", ("bf16", "fp32")), ("grad_dtype", ("fp32", "bf16")),
                         ("keep_expert_input", true_false), ("fp8", true_false),
                         ("fp8_dispatch", true_false), ("pre_softmax", true_false),
                         ("expert_bias", true_false), ("pad_to_capacity", true_false),
                         ("shared_gate", true_false), ("shared_expert_overlap", true_false),
                         ("gemm_autotune", true_false),
                         ("score_function", ("softmax", "sigmoid", "sqrtsoftplus")),
                         ("drop_policy", ("probs", "position")),
                         ("ep_transport", ("auto", "peer", "nccl", "copy"))):
        if key not in config:
            continue
        text = config[key]
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":  # a quoted string
            text = config[key] = text[1:-1]
        if text not in allowed:
            sys.exit(f"{path}: {key} = '{text}' must be {' or '.join(allowed)}")
    for key in ("pad_to_capacity", "drop_policy"):
        if key in config and config[key] != "false" and "capacity_factor" not in config:
            sys.exit(f"{path}: {key} = {config[key]} needs capacity_factor (capacity mode)")
    if int(config["topk"]) > int(config["num_experts"]):
        sys.exit(f"{path}: topk = {config['topk']} exceeds num_experts = {config['num_experts']}")
    # The config's own FP8 keys as the layer takes them (--fp8 prices a config without them: the
    # benchmark then sets the alignment, moe_bench --align-size 16).
    if config.get("fp8_dispatch") == "true" and config.get("fp8") != "true":
        sys.exit(f"{path}: fp8_dispatch = true needs fp8 = true (the experts' products read E4M3)")
    align = int(config.get("align_size", "0"))
    if config.get("fp8") == "true" and (align == 0 or align % 16):
        sys.exit(f"{path}: fp8 = true needs align_size a multiple of 16, got {align}")
    return config


def expert_products(H, F, rows):
    """(m, n, k) of one expert's products in a step, k the inner dimension: forward
    h = X·w13ᵀ and Y = a·w2ᵀ; backward dA = dY·w2, dX = dh·w13, dw2 = dYᵀ·a, dw13 = dhᵀ·X."""
    return [(rows, 2 * F, H), (rows, H, F), (rows, F, H), (rows, H, 2 * F), (H, F, rows),
            (2 * F, H, rows)]


def product_rate(k, args):
    """FLOP/s of a product with inner dimension k: each tile walks k and pays a fixed prologue
    and epilogue, so the rate is R · k / (k + k½), and no product runs faster than a dense one of
    the GPU (the sustained rate of an 8192³ product, held down by the power limit)."""
    return min(args.gemm_tflops * k / (k + args.half_rate_inner), args.dense_tflops) * 1e12


def products_seconds(H, F, rows, args, data_speedup=1.0):
    """One FFN's six products over `rows` rows; the four data products (all but the weight
    gradients) at data_speedup times the rate (FP8's gain)."""
    return sum(2 * m * n * k / product_rate(k, args) / (data_speedup if i < 4 else 1.0)
               for i, (m, n, k) in enumerate(expert_products(H, F, rows)))


def exchange_efficiency(args):
    """The share of the link rates an exchange reaches: as given, else the transport's measured
    one (docs/performance.md, "Exchange")."""
    if args.exchange_efficiency is not None:
        return args.exchange_efficiency
    return {"peer": 1.0, "nccl": 0.6, "copy": 0.65}[args.transport]


def exchange_chunks(transport, ep, local_experts, asked=None):
    """The chunks the layer pipelines the exchange in, as MoEConfig::effective_exchange_chunks
    picks them: none to pipeline on one GPU or over the peer exchange; else as asked or
    automatic (4), at most the local experts. (The layer's FP8 experts pipeline as the bf16 ones
    do; the model prices their exchanges, not their products.)"""
    if ep <= 1 or transport == "peer" or local_experts <= 1:
        return 1
    return min(asked if asked is not None else 4, local_experts)


def capacity_rows(factor, tokens, K, E, align):
    """An expert's capacity from one rank, as MoEConfig::expert_capacity computes it: at most
    factor · T · K / E rows, rounded up, at most T (an expert takes one slot of a token), then
    rounded up to a multiple of align_size."""
    rows = min(math.ceil(factor * (tokens * K) / E), tokens)  # the layer's order of operations
    return (rows + align - 1) // align * align if align > 1 else rows


def predict(config, tokens, ep, args):
    """Per-GPU times (ms) of one forward + backward at `tokens` tokens per GPU."""
    H = int(config["hidden"])
    F = int(config["ffn_hidden"])
    K = int(config["topk"])
    E = int(config["num_experts"])
    if E % ep:
        return None
    # Capacity mode: C rows an expert from each rank. Fixed blocks (pad_to_capacity) compute
    # EP · C rows an expert whatever the routing; otherwise the capacity caps the busiest GPU.
    factor = float(config.get("capacity_factor", "0"))
    fixed_blocks = factor > 0 and config.get("pad_to_capacity", "false") == "true"
    imbalance = args.imbalance
    if factor > 0:
        C = capacity_rows(factor, tokens, K, E, int(config.get("align_size", "0")))
        imbalance = min(imbalance, E * C / (tokens * K))
    act_bytes = 4 if config.get("dtype", "bf16") == "fp32" else 2
    row_bytes = H * act_bytes
    # An E4M3 row and its scales, one fp32 per 1 × 128 block.
    fp8_row_bytes = H + 4 * math.ceil(H / 128)
    # Expert GEMMs. Each GPU computes the rows its E/EP experts receive: T·K·EP/E each on average,
    # imbalance × that on the most loaded GPU, which the step waits for. A product's tiles each
    # walk its inner dimension k, paying a fixed prologue and epilogue: it runs at
    # rate · k / (k + half_rate_inner). That is what holds the weight gradients back (their k is
    # an expert's rows) and the products of narrow layers (k = H, F or 2F).
    rows = ep * C if fixed_blocks else tokens * K * ep / E * imbalance
    local_experts = E // ep
    fp8_experts = getattr(args, "fp8", False)
    compute_s = local_experts * products_seconds(
        H, F, rows, args, args.fp8_speedup if fp8_experts else 1.0)
    # They also read the weights twice (forward and backward; their E4M3 copies under FP8) and
    # write their gradients: a floor where few rows meet many experts.
    weight_values = local_experts * 3 * H * F
    weight_bytes = 1 if fp8_experts else act_bytes
    bytes_s = weight_values * (2 * weight_bytes + args.grad_bytes) / (args.copy_gbs * 1e9)
    gemm_ms = max(compute_s, bytes_s) * 1e3
    # FP8's passes of their own: the rows of X, a, dY and dh (2H + 3F values a row) read as bf16
    # and written as E4M3, and the weights read once and written twice (E4M3 and its transpose),
    # once an optimizer step of `micro_batches` steps. On one EP rank the permute writes X's and
    # dY's codes beside their rows instead, and under fp8_dispatch the receiver's sort copies the
    # codes that crossed (rows of whole 128-value blocks): one byte a value more, not three.
    quantize_ms = 0.0
    if fp8_experts:
        codes_beside_rows = ep == 1 or getattr(args, "fp8_dispatch", False)
        x_dy_bytes = 1 if codes_beside_rows and H % 128 == 0 else 3
        row_bytes_moved = local_experts * rows * (2 * H * x_dy_bytes + 3 * F * 3)
        quantize_ms = (row_bytes_moved + weight_values * 4 / args.micro_batches) / (
            args.copy_gbs * 1e9) * 1e3
        gemm_ms += quantize_ms
    # The shared experts: a dense FFN of width Fs over the GPU's T tokens, in series with the
    # routed path (the side stream hides under 10% of it where the routed products and the
    # exchange hold every SM, docs/performance.md "Shared experts").
    shared = int(config.get("shared_ffn_hidden", "0"))
    if shared > 0:
        gemm_ms += products_seconds(H, shared, tokens, args) * 1e3
    # The gate (forward and both backward products, 6·T·E·H FLOPs), at the dense rate.
    gemm_ms += 6 * tokens * E * H / product_rate(H, args) * 1e3
    # Each exchange moves every slot's row once; a slot stays on this GPU with probability 1/EP,
    # stays in the node with (gpn - 1)/EP more, and crosses nodes otherwise (uniform routing).
    # The rows that stay are still read and written once in HBM.
    gpn = min(args.gpus_per_node, ep)
    # Fixed blocks cross whole under EP, E · C rows a rank, zero rows included; on one GPU only
    # the kept slots' rows move, at most E · C of the T · K.
    slots = (E * C if ep > 1 else min(tokens * K, E * C)) if fixed_blocks else \
        tokens * K * imbalance
    efficiency = exchange_efficiency(args)

    def shares(row):
        """One exchange's bytes kept in HBM (read and written), over NVLink and over IB."""
        return (slots / ep * row * 2, slots * (gpn - 1) / ep * row, slots * (ep - gpn) / ep * row)

    def exchange_seconds(row):
        """HBM, NVLink and InfiniBand run side by side: an exchange takes its slowest share."""
        local, intra, inter = shares(row)
        return max(local / (args.copy_gbs * 1e9), intra / (args.nvlink_gbs * 1e9 * efficiency),
                   inter / (args.ib_gbs * 1e9 * efficiency))

    local, intra, inter = shares(row_bytes)
    # Dispatch, combine and their mirrors; the peer exchange stores x into the experts' rows once
    # more in the backward, unless the config keeps the experts' input from the forward. With
    # FP8 dispatch, the exchanges toward the experts (x, its second store, dy) carry E4M3 rows.
    keeps_input = config.get("keep_expert_input", "false") == "true"
    count = 5 if args.transport == "peer" and not keeps_input else 4
    toward = count - 2  # all but the combine's y and the backward's dx
    fp8 = getattr(args, "fp8_dispatch", False)
    in_row = fp8_row_bytes if fp8 else row_bytes
    exchanges_ms = ((count - toward) * exchange_seconds(row_bytes) +
                    toward * exchange_seconds(in_row)) * 1e3
    moved = (count - toward) * sum(shares(row_bytes)[1:]) + toward * sum(shares(in_row)[1:])
    serial = gemm_ms + exchanges_ms + args.fixed_ms
    # Overlap hides each exchange under the GEMMs of the other chunks, except the first dispatch
    # chunk and the last combine chunk of each direction (1/chunks of each exchange), but only as
    # far as the transfer leaves the GEMMs their SMs and HBM. Inside a node NCCL moves the rows
    # with kernels on the SMs, and a pipelined step on one host gained a share of what it hid
    # (docs/performance.md, "Exchange"); across nodes the NICs move them (assumed to hide whole,
    # not measured yet). Which link bounds the exchange picks the share.
    chunks = exchange_chunks(args.transport, ep, local_experts, args.chunks)
    exposed = exchanges_ms / chunks
    over_ib = inter / args.ib_gbs >= max(local / args.copy_gbs, intra / args.nvlink_gbs)
    share = args.overlap_share_ib if over_ib else args.overlap_share_nvlink
    # (never slower than running them in turn, nor faster than a pipeline of the two, direction
    # by direction: the forward's GEMMs are a third of the step's, the backward's two thirds, each
    # beside half of the exchanges. Where a direction's GEMMs are longer, they and its exposed
    # exchange chunks; else its exchanges, back to back on their stream, the returns of the
    # early chunks under the last chunk's GEMMs. One GPU has no exchange to pipeline: its
    # permutes run in series.)
    pipeline = sum(max(gemm_share * gemm_ms + exchanges_ms / 2 / chunks, exchanges_ms / 2)
                   for gemm_share in (1 / 3, 2 / 3))
    overlapped = serial if ep == 1 else min(
        serial, max(serial - share * (exchanges_ms - exposed), pipeline + args.fixed_ms))
    return {
        "ep": ep,
        "chunks": chunks,
        "nodes": (ep + args.gpus_per_node - 1) // args.gpus_per_node,
        "bytes_mb": moved / 1e6,
        "gemm_ms": gemm_ms,
        "quantize_ms": quantize_ms,
        "exchange_ms": exchanges_ms,
        "serial_ms": serial,
        "overlap_ms": overlapped,
    }


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: the config's)")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="max/mean rows per GPU (1 = perfectly balanced)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbs", type=float, default=330.0, help="NVLink GB/s per GPU")
    parser.add_argument("--ib-gbs", type=float, default=50.0, help="InfiniBand GB/s per GPU")
    parser.add_argument("--gemm-tflops", type=float, default=770.0,
                        help="the expert products' rate with a long inner dimension")
    parser.add_argument("--dense-tflops", type=float, default=715.0,
                        help="the rate no product exceeds: a dense 8192^3 product's, sustained")
    parser.add_argument("--half-rate-inner", type=float, default=380.0,
                        help="inner dimension at which a product reaches half that rate")
    parser.add_argument("--copy-gbs", type=float, default=4190.0, help="HBM copy rate, GB/s")
    parser.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4),
                        help="bytes of a weight gradient (4: fp32, 2: bf16)")
    parser.add_argument("--fixed-ms", type=float, default=0.3,
                        help="the router, the losses and the gate's small kernels per step")
    parser.add_argument("--transport", choices=("auto", "peer", "nccl", "copy"),
                        help="the EP exchange: peer memory (one node, at most 8 GPUs), NCCL, or "
                             "the copy engines (one node); auto: peer where it runs, else NCCL "
                             "(default: the config's ep_transport, else auto)")
    parser.add_argument("--exchange-efficiency", type=float,
                        help="share of the link rate an exchange reaches (default: the "
                             "transport's, peer 1, NCCL 0.6, copy 0.65)")
    parser.add_argument("--chunks", type=int,
                        help="the NCCL or copy exchange's chunks (default: the config's "
                             "exchange_chunks, else the layer's automatic count at each EP; the "
                             "peer exchange takes one)")
    parser.add_argument("--overlap-share-nvlink", type=float, default=0.15,
                        help="share of the hideable exchange time that overlap hides where "
                             "NVLink or HBM bounds the exchange (measured 0.06-0.27 at EP 2)")
    parser.add_argument("--overlap-share-ib", type=float, default=1.0,
                        help="the same where InfiniBand bounds it (assumed, not measured)")
    parser.add_argument("--fp8-dispatch", action="store_true",
                        help="the exchanges toward the experts (x, dy) carry E4M3 rows and their "
                             "1 x 128 scales")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 experts: data products at --fp8-speedup times the bf16 rate, "
                             "with the rows' and the weights' quantization")
    parser.add_argument("--fp8-speedup", type=float,
                        help="the FP8 data products' rate over the bf16 products' at the same "
                             "shape, in the layer (default 1.3; a dense 8192^3 product gains 1.6)")
    parser.add_argument("--micro-batches", type=int,
                        help="with --fp8: steps between two optimizer updates, which quantize the "
                             "weights once (default 1)")
    parser.add_argument("--capacity-factor", type=float,
                        help="capacity mode at this factor (default: the config's, else "
                             "dropless)")
    parser.add_argument("--pad-to-capacity", action="store_true",
                        help="with capacity mode: every expert's block exactly its capacity "
                             "(fixed shapes, over NCCL under EP)")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    return parser


FP8_DEFAULTS = {"fp8_speedup": 1.3, "micro_batches": 1}


def parse_args(argv=None):
    """The command line, with the FP8 options' defaults filled in; args.fp8_options names those
    given, which need FP8 experts (--fp8, or fp8: true in the config: see fp8_options_need_fp8).
    --fp8-dispatch alone is no such option: it prices the E4M3 rows' exchange on bf16 experts,
    a what-if the layer itself does not run (docs/design.md, "FP8 dispatch, priced")."""
    args = build_parser().parse_args(argv)
    args.fp8_options = []
    for name, default in FP8_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        else:
            args.fp8_options.append(name)
    return args


def fp8_options_need_fp8(args):
    """An FP8 option without FP8 experts would change nothing: each is refused by name once the
    config has had its say."""
    if args.fp8:
        return
    for name in args.fp8_options:
        sys.exit(f"--{name.replace('_', '-')} prices the FP8 experts: give --fp8 too")


# The most GPUs the peer exchange maps (docs/design.md, "Transports"); it and the copy exchange
# run inside one node.
PEER_MAX_RANKS = 8


def transport_at(transport, ep, gpus_per_node, fp8_dispatch=False, fixed_blocks=False):
    """The exchange priced at EP `ep`: auto resolved as the layer resolves it (E4M3 rows and
    fixed blocks cross over NCCL alone), or why the asked one cannot run there (a string starting
    with "no:")."""
    if ep <= 1:  # one GPU's local exchange, priced as the peer exchange's copies
        return "peer"
    one_node = ep <= gpus_per_node
    nccl_alone = fp8_dispatch or fixed_blocks
    if transport == "auto":
        return "peer" if one_node and ep <= PEER_MAX_RANKS and not nccl_alone else "nccl"
    if transport in ("peer", "copy") and fp8_dispatch:
        return f"no: FP8 dispatch runs over NCCL, not the {transport} exchange"
    if transport in ("peer", "copy") and fixed_blocks:
        return f"no: fixed blocks (pad_to_capacity) run over NCCL, not the {transport} exchange"
    if transport == "peer" and not (one_node and ep <= PEER_MAX_RANKS):
        return (f"no: the peer exchange runs on at most {PEER_MAX_RANKS} GPUs of one node "
                f"({gpus_per_node} GPUs a node)")
    if transport == "copy" and not one_node:
        return f"no: the copy exchange runs inside one node ({gpus_per_node} GPUs a node)"
    return transport


def main():
    args = parse_args()
    for name in ("overlap_share_nvlink", "overlap_share_ib"):
        value = getattr(args, name)
        if not math.isfinite(value) or not 0 <= value <= 1:
            sys.exit(f"--{name.replace('_', '-')} = {value} must be in [0, 1]")
    # Each option within a range that gives a prediction: rates so small, or times and factors so
    # large, that the step overflows give none. (max over mean is at most E; 10⁶ bounds any.)
    for name, low, high in (("imbalance", 1, 1e6), ("nvlink_gbs", 1e-6, 1e9),
                            ("ib_gbs", 1e-6, 1e9), ("gemm_tflops", 1e-6, 1e9),
                            ("dense_tflops", 1e-6, 1e9), ("copy_gbs", 1e-6, 1e9),
                            ("exchange_efficiency", 1e-6, 1), ("half_rate_inner", 0, 1e9),
                            ("fixed_ms", 0, 1e6), ("fp8_speedup", 1e-6, 1e3)):
        value = getattr(args, name)
        if value is None:  # --exchange-efficiency not given: the transport's own
            continue
        if not math.isfinite(value) or not low <= value <= high:
            sys.exit(f"--{name.replace('_', '-')} = {value} must be in [{low:g}, {high:g}]")
    for name, value, high in (("tokens", args.tokens, 2**30), ("gpus-per-node", args.gpus_per_node,
                                                              2**20),
                              ("chunks", args.chunks, 1024),
                              ("micro-batches", args.micro_batches, 2**20)):
        if value is not None and not 1 <= value <= high:
            sys.exit(f"--{name} = {value} must be in [1, {high}]")
    for ep in args.ep:
        if not 1 <= ep <= 2**20:
            sys.exit(f"--ep {ep} must be in [1, {2**20}]")
    config = read_config(args.config)
    # Capacity mode from the command line over the config's, as moe_bench takes it.
    if args.capacity_factor is not None:
        if not math.isfinite(args.capacity_factor) or not 0 < args.capacity_factor <= 1e4:
            sys.exit(f"--capacity-factor = {args.capacity_factor} must be in (0, 10000]")
        config["capacity_factor"] = repr(args.capacity_factor)
    if args.pad_to_capacity:
        if "capacity_factor" not in config:
            sys.exit("--pad-to-capacity needs capacity mode (--capacity-factor, or the config's)")
        config["pad_to_capacity"] = "true"
    fixed_blocks = config.get("pad_to_capacity") == "true"
    # The config's exchange and chunks, where the command line names none. Chunks asked on the
    # command line of an exchange that does not pipeline are refused; the config's are ignored
    # there, as the layer ignores them.
    if args.transport is None:
        args.transport = config.get("ep_transport", "auto")
    if args.transport == "peer" and args.chunks not in (None, 1):
        sys.exit(f"--chunks = {args.chunks}: the peer exchange does not pipeline")
    chunks_given = args.chunks is not None
    if not chunks_given and int(config.get("exchange_chunks", "0")) > 0:
        args.chunks = int(config["exchange_chunks"])
    asked_transport = args.transport
    # A config's own fp8 and fp8_dispatch (the layer's keys) price as the flags do.
    for key in ("fp8", "fp8_dispatch"):
        if config.get(key) == "true":
            setattr(args, key, True)
    fp8_options_need_fp8(args)
    if args.fp8:
        if config.get("dtype", "bf16") != "bf16":
            sys.exit(f"{args.config}: FP8 experts take bf16 rows and weights, not dtype = "
                     f"{config['dtype']}")
        for key in ("hidden", "ffn_hidden"):
            if int(config[key]) % 16:
                sys.exit(f"{args.config}: FP8 experts need {key} a multiple of 16, not "
                         f"{config[key]}")
    tokens = args.tokens if args.tokens is not None else int(config.get("tokens", 8192))
    if tokens < 1:
        sys.exit(f"{args.config}: tokens = {tokens}; give --tokens T (at least 1)")
    exchanges = (f"{args.transport} exchanges at {exchange_efficiency(args):.0%} of them"
                 if args.transport != "auto" else
                 ("auto: NCCL exchanges (E4M3 rows cross over NCCL alone)"
                  if getattr(args, "fp8_dispatch", False) else
                  "auto: NCCL exchanges (fixed blocks cross over NCCL alone)" if fixed_blocks else
                  f"auto: peer exchanges up to {PEER_MAX_RANKS} GPUs of a node, NCCL beyond") +
                 (f", at {args.exchange_efficiency:.0%} of them" if args.exchange_efficiency
                  is not None else ""))
    print(f"{args.config}: T = {tokens} per GPU, imbalance {args.imbalance}, NVLink "
          f"{args.nvlink_gbs:g} GB/s, IB {args.ib_gbs:g} GB/s ({exchanges}), "
          f"GEMM {args.gemm_tflops:g} TFLOP/s at "
          f"k / (k + {args.half_rate_inner:g}) up to {args.dense_tflops:g}, "
          f"{args.gpus_per_node} GPUs a node" +
          (f"; FP8 experts at {args.fp8_speedup:g}x, the weights quantized once in "
           f"{args.micro_batches} step(s)" if args.fp8 else "") +
          (f"; capacity factor {float(config['capacity_factor']):g}" +
           (", fixed blocks" if fixed_blocks else "") if "capacity_factor" in config else ""))
    print(f"{'EP':>5} {'nodes':>5} {'MB/GPU':>9} {'GEMM ms':>9} {'exch ms':>9} {'serial ms':>10} "
          f"{'chunks':>6} {'overlap ms':>11} {'hidden':>7}")
    predicted = 0
    for ep in args.ep:
        args.transport = transport_at(asked_transport, ep, args.gpus_per_node,
                                      getattr(args, "fp8_dispatch", False), fixed_blocks)
        if args.transport.startswith("no:"):
            print(f"{ep:>5}  {args.transport[4:]}")
            continue
        if args.imbalance > ep and not fixed_blocks:  # fixed blocks take no imbalance
            print(f"{ep:>5}  imbalance {args.imbalance:g} exceeds the EP: the busiest of {ep} "
                  f"GPU(s) holds at most {ep} times the mean")
            continue
        # (the config's chunks stand: the peer exchange ignores them, as the layer does)
        if args.transport == "peer" and ep > 1 and chunks_given and args.chunks != 1:
            print(f"{ep:>5}  the peer exchange (auto's here) does not pipeline: --chunks "
                  f"{args.chunks} is for NCCL or the copy exchange")
            continue
        p = predict(config, tokens, ep, args)
        if p is None:
            print(f"{ep:>5}  EP does not divide the {config['num_experts']} experts")
            continue
        if args.fp8 and int(config["num_experts"]) // ep > 512:
            print(f"{ep:>5}  FP8 experts take at most 512 experts a rank, not "
                  f"{int(config['num_experts']) // ep}")
            continue
        predicted += 1
        hidden = (p["serial_ms"] - p["overlap_ms"]) / p["exchange_ms"] if p["ep"] > 1 else 0
        print(f"{p['ep']:>5} {p['nodes']:>5} {p['bytes_mb']:>9.1f} {p['gemm_ms']:>9.3f} "
              f"{p['exchange_ms']:>9.3f} {p['serial_ms']:>10.3f} {p['chunks']:>6} "
              f"{p['overlap_ms']:>11.3f} "
              f"{hidden:>6.0%}" + (f"  {args.transport}" if asked_transport == "auto" else ""))
    if predicted == 0:
        sys.exit("no EP given has a prediction (each row above says why)")


if __name__ == "__main__":
    # Output piped into `head` ends quietly when the reader stops, as a shell tool does.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
