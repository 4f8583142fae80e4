#!/usr/bin/env python3
"""Sets scripts/cost_model.py's prediction beside each step that moe_bench measured: every
`moe_bench --json` file given is read for its config (configs/<config_file>, with the run's
shared_ffn_hidden), tokens per GPU, EP, exchange, pipeline chunks, gradient dtype, FP8 and
capacity settings, priced at the model's default rates as docs/design.md's table of measured steps is,
and printed as one row of that table: measured, predicted, error. Exits 1 when a point misses by
more than --limit (15% by default, the model's bound), 2 on a file that is no moe_bench report.

    python3 scripts/cost_model_check.py results/*.json [--limit 0.15]

Capacity mode's steps are priced with the run's capacity factor and fixed blocks (design.md,
"Capacity mode" under "Cost model").
"""
import argparse
import json
import math
import pathlib
import signal
import sys

import cost_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What a report must hold, and of which kind (a JSON true is no count).
FIELDS = {"config_file": str, "tokens_per_gpu": int, "ep": int, "ep_transport": str,
          "exchange_chunks": int, "total_ms": float, "grad_dtype": str, "shared_ffn_hidden": int,
          "fp8": bool, "fp8_dispatch": bool, "micro_batches": int, "capacity_factor": float}
KIND_NAMES = {str: "a string", int: "a whole number", float: "a number", bool: "true or false"}


def of_kind(value, kind):
    """Whether a JSON value is of the kind: a count whole, a number finite (a JSON integer of
    hundreds of digits overflows a float: none of them)."""
    if kind in (bool, str):
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and (kind is float or float(value).is_integer())
    except OverflowError:
        return False


def fail(message):
    print(f"cost_model_check.py: {message}", file=sys.stderr)
    sys.exit(2)


def read_report(path):
    """A moe_bench JSON report's fields the model reads, each checked for its type and range."""
    if not pathlib.Path(path).exists():
        fail(f"{path}: no such file")
    if not pathlib.Path(path).is_file():  # a device or a pipe would be read without end
        fail(f"{path}: not a regular file; a moe_bench --json report is one")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        fail(f"{path}: cannot be read as a moe_bench --json report: {error}")
    if not isinstance(report, dict):
        fail(f"{path}: not a moe_bench --json report (a JSON object)")
    fields = {}
    # keep_expert_input decides the peer exchange's fifth exchange: a report that names it is
    # priced with it, one that does not with the config's.
    if "keep_expert_input" in report:
        if not isinstance(report["keep_expert_input"], bool):
            fail(f"{path}: 'keep_expert_input' is {report['keep_expert_input']!r}, not true or "
                 "false")
        fields["keep_expert_input"] = report["keep_expert_input"]
    # pad_to_capacity decides capacity mode's shapes; a report from before moe_bench named it
    # could not ask for fixed blocks.
    fields["pad_to_capacity"] = False
    if "pad_to_capacity" in report:
        if not isinstance(report["pad_to_capacity"], bool):
            fail(f"{path}: 'pad_to_capacity' is {report['pad_to_capacity']!r}, not true or false")
        fields["pad_to_capacity"] = report["pad_to_capacity"]
    # align_size decides capacity mode's C: the run's (moe_bench --align-size), where it names it.
    if "align_size" in report:
        if not of_kind(report["align_size"], int) or not 0 <= report["align_size"] <= 4096:
            fail(f"{path}: 'align_size' is {report['align_size']!r}, not a whole number in "
                 "[0, 4096]")
        fields["align_size"] = int(report["align_size"])
    for name, kind in FIELDS.items():
        if name not in report:
            fail(f"{path}: no '{name}' (a moe_bench --json report holds it)")
        value = report[name]
        if not of_kind(value, kind):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
            fail(f"{path}: '{name}' is {shown}, not {KIND_NAMES[kind]}")
        fields[name] = int(value) if kind is int else value
    name = fields["config_file"]
    if "/" in name or name.startswith(".") or not name.endswith(".yaml") or \
            not (ROOT / "configs" / name).is_file():
        fail(f"{path}: config_file '{name}' is not a config of configs/")
    for name, low, high in (("tokens_per_gpu", 1, 2**30), ("ep", 1, 2**20),
                            ("exchange_chunks", 1, 1024), ("shared_ffn_hidden", 0, 2**20),
                            ("micro_batches", 1, 2**20)):
        if not low <= fields[name] <= high:
            fail(f"{path}: '{name}' = {fields[name]} is outside [{low}, {high}]")
    if not 1e-3 <= fields["total_ms"] < 1e9:
        fail(f"{path}: 'total_ms' = {fields['total_ms']} is no step time (1 µs to 10⁹ ms)")
    if not 0 <= fields["capacity_factor"] <= 1e4:
        fail(f"{path}: 'capacity_factor' = {fields['capacity_factor']} is outside [0, 10000] "
             "(0: dropless)")
    if fields["grad_dtype"] not in ("bf16", "fp32"):
        fail(f"{path}: 'grad_dtype' = {fields['grad_dtype']!r} is neither bf16 nor fp32")
    # moe_bench reports the exchange the block ran: `auto` on one GPU.
    if fields["ep_transport"] not in ("auto", "peer", "nccl", "copy"):
        fail(f"{path}: 'ep_transport' = {fields['ep_transport']!r} is none of auto, peer, nccl, "
             "copy")
    if fields["fp8_dispatch"] and not fields["fp8"]:
        fail(f"{path}: 'fp8_dispatch' without 'fp8': the layer runs no such step")
    if fields.get("pad_to_capacity") and fields["capacity_factor"] == 0:
        fail(f"{path}: 'pad_to_capacity' without capacity mode: the layer runs no such step")
    if fields.get("pad_to_capacity") and fields["ep"] > 1 and fields["ep_transport"] != "nccl":
        fail(f"{path}: fixed blocks (pad_to_capacity) over the {fields['ep_transport']} exchange: "
             "the layer runs them over NCCL alone")
    return fields


def point(path, fields):
    """The report's step, as design.md's tables price it: (row cells, error)."""
    config = cost_model.read_config(str(ROOT / "configs" / fields["config_file"]))
    config["shared_ffn_hidden"] = str(fields["shared_ffn_hidden"])
    # The run's capacity mode, whatever the config's (moe_bench's flags may have set it).
    config.pop("capacity_factor", None)
    config.pop("pad_to_capacity", None)
    if fields["capacity_factor"] > 0:
        config["capacity_factor"] = repr(fields["capacity_factor"])
        config["pad_to_capacity"] = "true" if fields["pad_to_capacity"] else "false"
    if "align_size" in fields:
        config["align_size"] = str(fields["align_size"])
    if "keep_expert_input" in fields:
        config["keep_expert_input"] = "true" if fields["keep_expert_input"] else "false"
    args = cost_model.parse_args([str(ROOT / "configs" / fields["config_file"])])
    ep = fields["ep"]
    transport = fields["ep_transport"] if ep > 1 else "peer"
    if transport == "auto":
        fail(f"{path}: 'ep_transport' = 'auto' at EP {ep}: a mesh's report names its exchange")
    args.transport = transport
    args.chunks = fields["exchange_chunks"] if transport != "peer" else None
    args.exchange_efficiency = cost_model.exchange_efficiency(args)
    args.grad_bytes = 2 if fields["grad_dtype"] == "bf16" else 4
    args.fp8 = fields["fp8"]
    args.fp8_dispatch = fields["fp8_dispatch"]
    args.micro_batches = fields["micro_batches"]
    p = cost_model.predict(config, fields["tokens_per_gpu"], ep, args)
    if p is None:
        fail(f"{path}: EP {ep} does not divide the {config['num_experts']} experts")
    measured = fields["total_ms"]
    error = (p["overlap_ms"] - measured) / measured
    exchange = "—" if ep == 1 else (
        transport if transport == "peer" else
        f"{transport}, {p['chunks']} chunk{'s' if p['chunks'] > 1 else ''}")
    shared = "yes" if fields["shared_ffn_hidden"] > 0 else "no"
    sign = "+" if error >= 0 else "−"
    capacity = "—" if fields["capacity_factor"] == 0 else (
        f"{fields['capacity_factor']:g}" + (", padded" if fields["pad_to_capacity"] else ""))
    cells = [fields["config_file"].removesuffix(".yaml"), str(ep), exchange, shared,
             f"{measured:.2f}", f"{p['overlap_ms']:.2f}", f"{sign}{abs(100 * error):.1f}%",
             capacity]
    return cells, error


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="moe_bench --json files")
    parser.add_argument("--limit", type=float, default=0.15,
                        help="the largest miss, as a share of the measured step (default 0.15)")
    args = parser.parse_args()
    if not math.isfinite(args.limit) or not 0 < args.limit <= 10:
        fail(f"--limit = {args.limit} must be in (0, 10]")
    # Every report read and priced before the table starts: a bad one stops with its error alone.
    points = [(path, *point(path, read_report(path))) for path in args.reports]
    print("| file | config | EP | exchange | shared experts | measured, ms | predicted, ms "
          "| error | capacity |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    misses = 0
    for path, cells, error in points:
        if abs(error) > args.limit:
            misses += 1
            cells[6] += f", beyond {args.limit:.0%}"
        print(f"| {path} | " + " | ".join(cells) + " |")
    if misses:
        print(f"{misses} of {len(args.reports)} points miss by more than {args.limit:.0%}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    # Output piped into `head` ends quietly when the reader stops, as a shell tool does.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
