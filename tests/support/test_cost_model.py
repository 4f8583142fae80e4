#!/usr/bin/env python3
"""Checks scripts/cost_model.py's arithmetic against the terms docs/design.md ("Cost model")
states, each isolated by rates that make the other terms vanish, and its predictions against the
measured steps of design.md's table: each is the model's, and within 15% of its measurement."""
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import types
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import cost_model  # noqa: E402


DEFAULTS = dict(imbalance=1.0, gpus_per_node=8, nvlink_gbs=330.0, ib_gbs=50.0,
                gemm_tflops=770.0, dense_tflops=715.0, half_rate_inner=380.0, copy_gbs=4190.0,
                grad_bytes=4, fixed_ms=0.3, transport="peer", exchange_efficiency=None, chunks=None,
                overlap_share_nvlink=0.15, overlap_share_ib=1.0, fp8=False, fp8_speedup=1.3,
                micro_batches=1)
R, DENSE, K_HALF = 770e12, 715e12, 380


def rates(**overrides):
    """The script's defaults (docs/design.md's rates), with some replaced."""
    return types.SimpleNamespace(**{**DEFAULTS, **overrides})


def layer(H, F, E, K, dtype="bf16", **more):
    return {"hidden": str(H), "ffn_hidden": str(F), "num_experts": str(E), "topk": str(K),
            "dtype": dtype, **{key: str(value) for key, value in more.items()}}


# Rates that take a term out: products at their full rate, copies and links that cost nothing.
INSTANT = 1e12

def measured_points(header=("| run | config | EP | exchange | shared experts | measured, ms "
                            "| predicted, ms | error |")):
    """The rows of one of design.md's tables of measured steps (by default "Checked against the
    measured steps"), as cells."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = []
    for line in text[text.index(header):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def capacity_points():
    """The rows of design.md's table of capacity mode's measured steps."""
    return measured_points("| run | config | EP | exchange | T | capacity | measured, ms "
                           "| predicted, ms | error |")


def exchange_rates(exchange):
    """A table's exchange cell ("copy, 4 chunks", "nccl", "—") as the model's transport and
    chunks: one GPU's local exchange counts as the peer exchange's, a plain "nccl" is the exchange
    in one piece."""
    transport, _, chunks = exchange.partition(", ")
    return {"transport": "peer" if transport == "—" else transport,
            "chunks": int(chunks.split()[0]) if chunks else 1}


class CostModel(unittest.TestCase):
    def assert_point(self, config, ep, args, measured, predicted, error, tokens=8192):
        """A row of design.md's measured steps: its prediction is the model's (to its rounding),
        its error the one printed, and within 15%."""
        p = cost_model.predict(config, tokens, ep, args)
        self.assertAlmostEqual(p["overlap_ms"], float(predicted), delta=0.006)
        miss = (p["overlap_ms"] - float(measured)) / float(measured)
        self.assertAlmostEqual(100 * miss, float(error.replace("−", "-").rstrip("%")), delta=0.06)
        self.assertLessEqual(abs(miss), 0.15)

    def test_products_at_full_rate_count_18_HFTK_plus_the_gate(self):
        H, F, E, K, T = 1024, 512, 8, 2, 4096
        args = rates(half_rate_inner=0, copy_gbs=INSTANT, nvlink_gbs=INSTANT, fixed_ms=0)
        for ep in (1, 2, 8):
            p = cost_model.predict(layer(H, F, E, K), T, ep, args)
            want = (18 * H * F * T * K + 6 * T * E * H) / DENSE * 1e3  # R above the dense rate
            self.assertAlmostEqual(p["gemm_ms"], want, delta=want * 1e-12)

    def test_imbalance_scales_the_most_loaded_gpus_products(self):
        H, F, E, K, T = 1024, 512, 8, 2, 4096
        args = rates(half_rate_inner=0, copy_gbs=INSTANT, fixed_ms=0)
        gate = 6 * T * E * H / DENSE * 1e3
        even = cost_model.predict(layer(H, F, E, K), T, 2, args)["gemm_ms"] - gate
        args.imbalance = 1.5
        skewed = cost_model.predict(layer(H, F, E, K), T, 2, args)["gemm_ms"] - gate
        self.assertAlmostEqual(skewed / even, 1.5, places=12)

    def test_each_product_runs_at_k_over_k_plus_the_half_rate_inner_dimension(self):
        # H 1024, F 512 and 256 rows per expert: the inner dimensions are h = X·w13ᵀ: H,
        # Y = a·w2ᵀ: F, dA = dY·w2: H, dX = dh·w13: 2F, dw2 = dYᵀ·a and dw13 = dhᵀ·X: the rows.
        H, F, E, K, T = 1024, 512, 8, 2, 1024
        rows = T * K // E
        products = [(2 * rows * 2 * F * H, H), (2 * rows * H * F, F), (2 * rows * F * H, H),
                    (2 * rows * H * 2 * F, 2 * F), (2 * H * F * rows, rows),
                    (2 * 2 * F * H * rows, rows)]
        want = sum(flops * E / min(R * k / (k + K_HALF), DENSE) for flops, k in products)
        want += 6 * T * E * H / min(R * H / (H + K_HALF), DENSE)
        got = cost_model.predict(layer(H, F, E, K), T, 1, rates(copy_gbs=INSTANT, fixed_ms=0))
        self.assertAlmostEqual(got["gemm_ms"], want * 1e3, delta=want * 1e-9)

    def test_the_configs_chunks_and_fp8_dispatch_resolve_as_the_layer_does(self):
        script = str(SCRIPTS / "cost_model.py")
        with tempfile.TemporaryDirectory() as d:
            def rows(body, *extra):
                path = pathlib.Path(d) / "c.yaml"
                path.write_text("hidden: 1024\nffn_hidden: 512\nnum_experts: 64\ntopk: 2\n" + body)
                r = subprocess.run([sys.executable, script, str(path), *extra],
                                   capture_output=True, text=True)
                return r.returncode, r.stdout.splitlines()[2:], r.stderr
            # The config's chunks pipeline NCCL and the copy exchange; the peer exchange, which
            # auto takes inside a node, and one GPU ignore them, as the layer does.
            code, out, err = rows("exchange_chunks: 4\nactivation_chunk_mib: 0.5\n",
                                  "--ep", "1", "2", "16")
            self.assertEqual(code, 0, err)
            self.assertEqual([(r[0], r[6], r[-1]) for r in map(str.split, out)],
                             [("1", "1", "peer"), ("2", "1", "peer"), ("16", "4", "nccl")])
            code, out, err = rows("exchange_chunks: 4\nep_transport: peer\n", "--ep", "2")
            self.assertEqual(code, 0, err)
            # E4M3 rows cross over NCCL alone: auto takes it, peer and copy are named.
            code, out, err = rows("", "--fp8-dispatch", "--ep", "1", "2")
            self.assertEqual(code, 0, err)
            self.assertEqual([r.split()[-1] for r in out], ["peer", "nccl"])
            code, out, err = rows("", "--fp8-dispatch", "--transport", "copy", "--ep", "2")
            self.assertNotEqual(code, 0)
            self.assertIn("FP8 dispatch runs over NCCL, not the copy exchange", out[0])
            r = subprocess.run([sys.executable, script, str(pathlib.Path(d) / "missing.yaml")],
                               capture_output=True, text=True)
            self.assertIn("missing.yaml: no such file", r.stderr)

    def test_the_defaults_are_the_rates_the_design_states(self):
        parsed = vars(cost_model.parse_args(["config.yaml"]))
        # The exchange is the config's, or auto, once the config is read (main): none yet.
        self.assertIsNone(parsed["transport"])
        self.assertEqual({key: parsed[key] for key in DEFAULTS if key != "transport"},
                         {key: value for key, value in DEFAULTS.items() if key != "transport"})

    def test_auto_is_the_peer_exchange_inside_a_node_of_eight_and_nccl_beyond(self):
        self.assertEqual(cost_model.transport_at("auto", 1, 8), "peer")
        self.assertEqual(cost_model.transport_at("auto", 8, 8), "peer")
        self.assertEqual(cost_model.transport_at("auto", 16, 8), "nccl")
        self.assertEqual(cost_model.transport_at("auto", 16, 16), "nccl")  # peer maps at most 8
        self.assertEqual(cost_model.transport_at("auto", 4, 2), "nccl")
        self.assertTrue(cost_model.transport_at("peer", 16, 16).startswith("no:"))
        self.assertTrue(cost_model.transport_at("copy", 16, 8).startswith("no:"))
        self.assertEqual(cost_model.transport_at("copy", 16, 16), "copy")
        self.assertEqual(cost_model.transport_at("nccl", 256, 8), "nccl")

    def test_few_rows_on_many_experts_are_bound_by_the_weights_bytes(self):
        H, F, E, K, T = 4096, 2048, 256, 1, 1
        args = rates(fixed_ms=0, gemm_tflops=1e9)  # products cost next to nothing
        p = cost_model.predict(layer(H, F, E, K), T, 1, args)
        want = E * 3 * H * F * (2 * 2 + 4) / 4190e9 * 1e3
        self.assertAlmostEqual(p["gemm_ms"], want, delta=want * 1e-6)
        bf16_grads = cost_model.predict(layer(H, F, E, K), T, 1, rates(
            fixed_ms=0, gemm_tflops=1e9, grad_bytes=2))
        self.assertAlmostEqual(bf16_grads["gemm_ms"] / p["gemm_ms"], 6 / 8, places=5)

    def test_an_exchange_inside_a_node_moves_the_rows_that_leave_over_nvlink(self):
        H, F, E, K, T = 2048, 512, 16, 4, 8192
        for ep, efficiency in ((2, 1.0), (8, 0.6)):
            args = rates(copy_gbs=INSTANT, transport="nccl", exchange_efficiency=efficiency)
            p = cost_model.predict(layer(H, F, E, K), T, ep, args)
            leaving = T * K * (ep - 1) / ep * H * 2
            want = 4 * leaving / (330e9 * efficiency) * 1e3
            self.assertAlmostEqual(p["exchange_ms"], want, delta=want * 1e-12)
            self.assertAlmostEqual(p["bytes_mb"], 4 * leaving / 1e6, places=6)

    def test_fp8_dispatch_carries_e4m3_rows_and_scales_toward_the_experts(self):
        H, F, E, K, T = 7168, 2048, 256, 8, 8192
        fp8_row, bf16_row = H + 4 * (H // 128), 2 * H
        for transport, toward in (("nccl", 2), ("peer", 3)):
            args = rates(copy_gbs=INSTANT, transport=transport, exchange_efficiency=1.0)
            plain = cost_model.predict(layer(H, F, E, K), T, 8, args)
            args.fp8_dispatch = True
            fp8 = cost_model.predict(layer(H, F, E, K), T, 8, args)
            count = 2 + toward
            leaving = T * K * 7 / 8
            want = ((count - toward) * bf16_row + toward * fp8_row) * leaving
            self.assertAlmostEqual(fp8["bytes_mb"], want / 1e6, places=6)
            self.assertAlmostEqual(fp8["exchange_ms"], want / 330e9 * 1e3,
                                   delta=fp8["exchange_ms"] * 1e-12)
            self.assertAlmostEqual(plain["bytes_mb"], count * bf16_row * leaving / 1e6, places=6)
            self.assertEqual(fp8["gemm_ms"], plain["gemm_ms"])
        # A width that is no multiple of 128 pays a whole scale for its last block.
        args = rates(copy_gbs=INSTANT, transport="nccl", exchange_efficiency=1.0, fp8_dispatch=True)
        p = cost_model.predict(layer(200, 64, 8, 2), 1024, 2, args)
        want = (2 * 400 + 2 * (200 + 4 * 2)) * 1024 * 2 / 2
        self.assertAlmostEqual(p["bytes_mb"], want / 1e6, places=9)

    def test_across_nodes_the_infiniband_share_bounds_the_exchange(self):
        H, F, E, K, T = 2048, 512, 64, 4, 8192
        args = rates(copy_gbs=INSTANT, transport="nccl", exchange_efficiency=1.0)
        p = cost_model.predict(layer(H, F, E, K), T, 32, args)  # 4 nodes of 8
        self.assertEqual(p["nodes"], 4)
        crossing = T * K * 24 / 32 * H * 2
        self.assertAlmostEqual(p["exchange_ms"], 4 * crossing / 50e9 * 1e3,
                               delta=p["exchange_ms"] * 1e-12)

    def test_one_gpu_copies_the_rows_once_and_overlaps_nothing(self):
        H, F, E, K, T = 2048, 512, 16, 4, 8192
        p = cost_model.predict(layer(H, F, E, K, dtype="fp32"), T, 1, rates(transport="nccl"))
        want = 4 * T * K * H * 4 * 2 / 4190e9 * 1e3
        self.assertAlmostEqual(p["exchange_ms"], want, delta=want * 1e-12)
        self.assertEqual(p["overlap_ms"], p["serial_ms"])
        self.assertAlmostEqual(p["serial_ms"], p["gemm_ms"] + p["exchange_ms"] + 0.3, places=12)

    def test_overlap_leaves_one_chunk_of_the_exchanges_exposed(self):
        H, F, E, K, T = 7168, 2048, 256, 8, 8192
        nccl = dict(transport="nccl", exchange_efficiency=1.0, chunks=4)
        p = cost_model.predict(layer(H, F, E, K), T, 8, rates(**nccl, overlap_share_nvlink=1.0))
        self.assertGreater(p["gemm_ms"], p["exchange_ms"])
        self.assertAlmostEqual(p["overlap_ms"], p["gemm_ms"] + p["exchange_ms"] / 4 + 0.3,
                               places=12)
        # Inside a node the transfer's kernels share the SMs: only a share of it hides.
        shared = cost_model.predict(layer(H, F, E, K), T, 8, rates(**nccl))
        self.assertAlmostEqual(shared["overlap_ms"],
                               shared["serial_ms"] - 0.15 * shared["exchange_ms"] * 3 / 4,
                               places=12)
        # Across nodes InfiniBand bounds the exchange, and its share applies, down to a pipeline
        # whose exchanges run back to back in each direction (the exchanges dominate both).
        nodes = cost_model.predict(layer(H, F, E, K), T, 32, rates(**nccl, overlap_share_ib=0.5))
        self.assertGreater(nodes["exchange_ms"] / 2, nodes["gemm_ms"] * 2 / 3)
        self.assertAlmostEqual(nodes["overlap_ms"],
                               max(nodes["serial_ms"] - 0.5 * nodes["exchange_ms"] * 3 / 4,
                                   nodes["exchange_ms"] + 0.3), places=12)
        whole = cost_model.predict(layer(H, F, E, K), T, 32, rates(**nccl, overlap_share_ib=1.0))
        self.assertAlmostEqual(whole["overlap_ms"], whole["exchange_ms"] + 0.3, places=12)
        self.assertLess(whole["overlap_ms"], whole["serial_ms"])
        # Where the forward's exchanges outlast its GEMMs and the backward's GEMMs outlast its
        # exchanges, each direction takes its own bound: the exchanges equal to the GEMMs.
        even = rates(**nccl, overlap_share_nvlink=1.0, copy_gbs=INSTANT, fixed_ms=0)
        p = cost_model.predict(layer(H, F, E, K), T, 8, even)
        G, X = p["gemm_ms"], p["exchange_ms"]
        even.nvlink_gbs = 330.0 * X / G  # exchanges as long as the GEMMs
        p = cost_model.predict(layer(H, F, E, K), T, 8, even)
        G, X = p["gemm_ms"], p["exchange_ms"]
        self.assertAlmostEqual(X, G, places=9)
        self.assertAlmostEqual(p["overlap_ms"], X / 2 + (2 * G / 3 + X / 2 / 4), places=9)
        # Where the exchanges dominate, chunks never make the step slower than in series.
        slow_links = cost_model.predict(layer(H, F, E, K), T, 8, rates(**nccl, nvlink_gbs=1.0))
        self.assertLessEqual(slow_links["overlap_ms"], slow_links["serial_ms"])

    def test_the_chunks_are_the_layers_automatic_count_unless_asked(self):
        chunks = cost_model.exchange_chunks
        self.assertEqual(chunks("nccl", 1, 256), 1)  # one GPU: nothing to pipeline
        self.assertEqual(chunks("peer", 4, 64), 1)  # the peer exchange does not pipeline
        self.assertEqual(chunks("nccl", 2, 128), 4)
        self.assertEqual(chunks("copy", 2, 128), 4)  # over the copy engines as over NCCL
        self.assertEqual(chunks("copy", 4, 64), 4)
        self.assertEqual(chunks("copy", 8, 32, asked=2), 2)
        self.assertEqual(chunks("nccl", 4, 2), 2)  # at most the local experts
        self.assertEqual(chunks("nccl", 8, 1), 1)
        # In one piece nothing overlaps: the step is the serial one.
        H, F, E, K, T = 7168, 2048, 256, 8, 8192
        p = cost_model.predict(layer(H, F, E, K), T, 2, rates(transport="copy", chunks=1))
        self.assertEqual((p["chunks"], p["overlap_ms"]), (1, p["serial_ms"]))
        for ep in (2, 4):
            p = cost_model.predict(layer(H, F, E, K), T, ep, rates(transport="copy"))
            self.assertEqual(p["chunks"], 4)
            self.assertLess(p["overlap_ms"], p["serial_ms"])

    def test_the_peer_exchange_stores_x_again_unless_the_input_is_kept(self):
        H, F, E, K, T = 2048, 512, 16, 4, 8192
        nccl = cost_model.predict(layer(H, F, E, K), T, 4, rates(transport="nccl",
                                                                 exchange_efficiency=1.0))
        peer = cost_model.predict(layer(H, F, E, K), T, 4, rates())
        kept = cost_model.predict(layer(H, F, E, K, keep_expert_input="true"), T, 4, rates())
        self.assertAlmostEqual(peer["exchange_ms"] / nccl["exchange_ms"], 5 / 4, places=12)
        self.assertAlmostEqual(kept["exchange_ms"], nccl["exchange_ms"], places=12)
        # Unless given, the efficiency is the transport's: NCCL's 0.6.
        slower = cost_model.predict(layer(H, F, E, K), T, 4, rates(transport="nccl"))
        self.assertAlmostEqual(slower["exchange_ms"] * 0.6, nccl["exchange_ms"], places=12)
        # The copy exchange: four exchanges whatever keep_expert_input says, at its 0.65.
        copy = cost_model.predict(layer(H, F, E, K), T, 4, rates(transport="copy"))
        self.assertAlmostEqual(copy["exchange_ms"] * 0.65, nccl["exchange_ms"], places=12)

    def test_no_product_runs_faster_than_a_dense_one(self):
        H, F, E, K, T = 8192, 8192, 1, 1, 8192  # every inner dimension 8192 or 16384
        args = rates(copy_gbs=INSTANT, fixed_ms=0, gemm_tflops=1e6)
        p = cost_model.predict(layer(H, F, E, K), T, 1, args)
        want = (18 * H * F * T + 6 * T * E * H) / DENSE * 1e3
        self.assertAlmostEqual(p["gemm_ms"], want, delta=want * 1e-12)

    def test_shared_experts_add_an_ffn_over_every_token(self):
        H, F, E, K, T, Fs = 1024, 512, 8, 2, 4096, 768
        args = rates(half_rate_inner=0, copy_gbs=INSTANT, fixed_ms=0)
        plain = cost_model.predict(layer(H, F, E, K), T, 2, args)
        shared = cost_model.predict(layer(H, F, E, K, shared_ffn_hidden=Fs), T, 2, args)
        self.assertAlmostEqual(shared["gemm_ms"] - plain["gemm_ms"], 18 * T * H * Fs / DENSE * 1e3,
                               places=9)

    def test_the_config_keys_are_the_layers(self):
        loader = (ROOT / "core" / "config_file.cpp").read_text(encoding="utf-8")
        table = loader[loader.index("const std::map<std::string, Setter> setters"):]
        table = table[:table.index("};")]
        self.assertEqual(cost_model.LAYER_KEYS, set(re.findall(r'\{"(\w+)",', table)))

    def test_the_designs_measured_points_are_the_models_and_within_15_percent(self):
        rows = measured_points()
        self.assertGreaterEqual(len(rows), 50)
        for run, name, ep, exchange, shared, measured, predicted, error in rows:
            with self.subTest(run=run, config=name, ep=ep, exchange=exchange, shared=shared):
                config = cost_model.read_config(str(ROOT / "configs" / f"{name}.yaml"))
                if shared == "no":
                    config["shared_ffn_hidden"] = "0"
                args = rates(**exchange_rates(exchange))
                if "bf16 gradients" in run:
                    args.grad_bytes = 2
                tokens = re.search(r"T = (\d+)", run)  # 8192 per GPU unless the run names another
                self.assert_point(config, int(ep), args, measured, predicted, error,
                                  int(tokens.group(1)) if tokens else 8192)

    def test_the_designs_capacity_points_are_the_models_and_within_15_percent(self):
        rows = capacity_points()
        self.assertGreaterEqual(len(rows), 31)
        for run, name, ep, exchange, tokens, capacity, measured, predicted, error in rows:
            with self.subTest(run=run, config=name, ep=ep, tokens=tokens, capacity=capacity):
                config = cost_model.read_config(str(ROOT / "configs" / f"{name}.yaml"))
                factor, _, padded = capacity.partition(", ")
                config["capacity_factor"] = factor
                config["pad_to_capacity"] = "true" if padded == "padded" else "false"
                self.assert_point(config, int(ep), rates(**exchange_rates(exchange)), measured,
                                  predicted, error, int(tokens))

    def test_capacity_mode_prices_fixed_blocks_and_caps_the_imbalance(self):
        H, F, E, K, T = 1024, 512, 64, 4, 1000
        args = rates(copy_gbs=INSTANT, nvlink_gbs=INSTANT, fixed_ms=0, transport="nccl",
                     chunks=1)
        # C = ceil(1.25 · 1000 · 4 / 64) = 79, rounded up to 16: 80 rows from each rank.
        self.assertEqual(cost_model.capacity_rows(1.25, T, K, E, 16), 80)
        self.assertEqual(cost_model.capacity_rows(1.25, T, K, E, 0), 79)
        self.assertEqual(cost_model.capacity_rows(100.0, T, K, E, 0), T)  # at most T
        fixed = layer(H, F, E, K, capacity_factor=1.25, pad_to_capacity="true", align_size=16)
        for ep in (1, 2, 4):
            p = cost_model.predict(fixed, T, ep, args)
            # Products: the EP · 80 rows of each local expert, as dropless rows of that count.
            even = cost_model.predict(layer(H, F, E, K), 80 * E // K, ep, args)
            gate = 6 * E * H / cost_model.product_rate(H, args) * 1e3
            self.assertAlmostEqual(p["gemm_ms"] - T * gate, even["gemm_ms"] - 80 * E // K * gate,
                                   places=9)
            # Exchanges: E · 80 rows a rank under EP, zero rows included; T · K on one GPU.
            if ep > 1:
                self.assertAlmostEqual(p["bytes_mb"], even["bytes_mb"], places=6)
        # On one GPU only the kept slots' rows move: at factor 0.5 (C = 32, E · C = 2048 of the
        # 4000 slots) about half the dropless local exchange.
        one_gpu = rates(fixed_ms=0, transport="peer")
        half = layer(H, F, E, K, capacity_factor=0.5, pad_to_capacity="true", align_size=16)
        self.assertEqual(cost_model.capacity_rows(0.5, T, K, E, 16), 32)
        self.assertAlmostEqual(
            cost_model.predict(half, T, 1, one_gpu)["exchange_ms"] /
            cost_model.predict(layer(H, F, E, K), T, 1, one_gpu)["exchange_ms"], 2048 / 4000,
            places=12)
        # Fixed blocks ignore the imbalance; a capacity without them caps it at E · C / (T · K).
        skewed = rates(copy_gbs=INSTANT, nvlink_gbs=INSTANT, fixed_ms=0, transport="nccl",
                       chunks=1, imbalance=3.0)
        self.assertEqual(cost_model.predict(fixed, T, 4, skewed), cost_model.predict(fixed, T, 4,
                                                                                     args))
        capped = layer(H, F, E, K, capacity_factor=1.25, align_size=16)
        cap = 80 * E / (T * K)  # 1.28
        self.assertEqual(cost_model.predict(capped, T, 4, skewed),
                         cost_model.predict(layer(H, F, E, K), T, 4,
                                            rates(**{**vars(skewed), "imbalance": cap})))
        # Fixed blocks cross over NCCL alone.
        self.assertEqual(cost_model.transport_at("auto", 2, 8, fixed_blocks=True), "nccl")
        self.assertEqual(cost_model.transport_at("auto", 1, 8, fixed_blocks=True), "peer")
        self.assertTrue(cost_model.transport_at("copy", 2, 8, fixed_blocks=True).startswith(
            "no: fixed blocks (pad_to_capacity) run over NCCL"))

    def test_fp8_speeds_the_data_products_and_adds_the_quantization_passes(self):
        H, F, E, K, T = 1024, 512, 8, 2, 4096
        rows = T * K // E
        # Products alone: the four data products (inner dimension H, F, H, 2F) at 1.3 times.
        args = rates(copy_gbs=INSTANT, fixed_ms=0)
        plain = cost_model.predict(layer(H, F, E, K), T, 1, args)
        args.fp8 = True
        fp8 = cost_model.predict(layer(H, F, E, K), T, 1, args)
        data = sum(2 * m * n * k / min(R * k / (k + K_HALF), DENSE) for m, n, k in
                   ((rows, 2 * F, H), (rows, H, F), (rows, F, H), (rows, H, 2 * F))) * E
        self.assertAlmostEqual(plain["gemm_ms"] - fp8["gemm_ms"], data * (1 - 1 / 1.3) * 1e3,
                               delta=1e-9)
        # The passes alone: the rows' 3 bytes a value (2H + 3F values a row; X's and dY's 2H one
        # byte on one EP rank, where the permute writes their codes, and under fp8_dispatch, where
        # the receiver's sort copies them), the weights' 4, once in `micro_batches` steps.
        for ep, dispatch, x_dy_bytes in ((1, False, 1), (2, False, 3), (2, True, 1)):
            for micro_batches in (1, 4):
                args = rates(gemm_tflops=1e9, dense_tflops=1e9, nvlink_gbs=INSTANT, fixed_ms=0,
                             fp8=True, fp8_dispatch=dispatch, micro_batches=micro_batches)
                p = cost_model.predict(layer(H, F, E, K), T, ep, args)
                experts = E // ep
                want = (experts * rows * ep * (2 * H * x_dy_bytes + 3 * F * 3) +
                        experts * 3 * H * F * 4 / micro_batches) / 4190e9
                self.assertAlmostEqual(p["quantize_ms"], want * 1e3, delta=want * 1e-9)

    def test_the_designs_measured_fp8_points_are_the_models_and_within_15_percent(self):
        rows = measured_points(
            "| run | config | EP | exchange | FP8 | measured, ms | predicted, ms | error |")
        self.assertGreaterEqual(len(rows), 15)
        for run, name, ep, exchange, mode, measured, predicted, error in rows:
            with self.subTest(run=run, config=name, ep=ep, exchange=exchange, mode=mode):
                config = cost_model.read_config(str(ROOT / "configs" / f"{name}.yaml"))
                args = rates(**exchange_rates(exchange), fp8=True, fp8_dispatch="dispatch" in mode,
                             micro_batches=int(mode.split()[-1]) if "once in" in mode else 1)
                self.assert_point(config, int(ep), args, measured, predicted, error)

    def test_an_ep_that_does_not_divide_the_experts_has_no_prediction(self):
        self.assertIsNone(cost_model.predict(layer(1024, 512, 60, 4), 1024, 8, rates()))

    def test_the_command_line_names_what_is_wrong(self):
        script = str(SCRIPTS / "cost_model.py")
        with tempfile.TemporaryDirectory() as d:
            config = pathlib.Path(d) / "c.yaml"
            config.write_text("hidden: 1024\nffn_hidden: 512\nnum_experts: 8\n")
            r = subprocess.run([sys.executable, script, str(config)], capture_output=True,
                               text=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("'topk' is missing", r.stderr)
            config.write_text("hidden: 1024\nffn_hidden: 512\nnum_experts: 8\ntopk: 2\n")
            r = subprocess.run([sys.executable, script, str(config), "--copy-gbs", "0"],
                               capture_output=True, text=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("--copy-gbs = 0.0 must be in [1e-06, 1e+09]", r.stderr)
            for extra, message in ((["--imbalance", "nan"], "--imbalance = nan must be in [1, 1e+06]"),
                                   (["--chunks", "4", "--transport", "peer"],
                                    "the peer exchange does not pipeline"),
                                   (["--ep", "3", "5"], "no EP given has a prediction"),
                                   (["--transport", "copy", "--ep", "16"],
                                    "no EP given has a prediction"),
                                   (["--chunks", "0", "--transport", "nccl"],
                                    "--chunks = 0 must be in [1, 1024]"),
                                   (["--ep", "4", "0"], "--ep 0 must be in [1, 1048576]"),
                                   (["--fixed-ms", "-1"], "--fixed-ms = -1.0 must be in [0, 1e+06]"),
                                   (["--tokens", "0"], "--tokens = 0 must be in [1, 1073741824]"),
                                   (["--tokens", "1" + "0" * 400], "must be in [1, 1073741824]"),
                                   (["--half-rate-inner", "1e308"],
                                    "--half-rate-inner = 1e+308 must be in [0, 1e+09]"),
                                   (["--micro-batches", "4"], "--micro-batches prices the FP8"),
                                   (["--capacity-factor", "0"],
                                    "--capacity-factor = 0.0 must be in (0, 10000]"),
                                   (["--capacity-factor", "nan"],
                                    "--capacity-factor = nan must be in (0, 10000]"),
                                   (["--pad-to-capacity"],
                                    "--pad-to-capacity needs capacity mode"),
                                   (["--capacity-factor", "1", "--pad-to-capacity",
                                     "--transport", "copy", "--ep", "2"],
                                    "no EP given has a prediction"),
                                   (["--fp8-speedup", "1.3"], "--fp8-speedup prices the FP8"),
                                   (["--fp8", "--micro-batches", "0"],
                                    "--micro-batches = 0 must be in [1, 1048576]"),
                                   (["--fp8", "--fp8-speedup", "0"],
                                    "--fp8-speedup = 0.0 must be in [1e-06, 1000]")):
                r = subprocess.run([sys.executable, script, str(config), *extra],
                                   capture_output=True, text=True)
                self.assertNotEqual(r.returncode, 0, extra)
                self.assertIn(message, r.stderr)
            for text, message in (("hidden: 1024\nhidden: 512\n", "'hidden' appears twice"),
                                  ("hidden: 16.5\n", "hidden = '16.5' is not a decimal integer"),
                                  ("hidden: 16#c\n", "hidden = '16#c' is not a decimal integer"),
                                  ("hidden: 016\n", "hidden = '016' is not a decimal integer"),
                                  ("hidden: +-16\n", "hidden = '+-16' is not a decimal integer"),
                                  ("topk: -2\n", "topk = -2 must be in [1, 16]"),
                                  ("activation_chunk_mib: 1_0\n",
                                   "activation_chunk_mib = '1_0' is not a finite number"),
                                  ("scaling_factor: 0\n",
                                   "scaling_factor = '0' is not a finite number in [1e-06, 1e+06]"),
                                  ("capacity_factor: 0\n", "capacity_factor = 0 must be positive"),
                                  ("num_experts: 0\n", "num_experts = 0 must be in [1, 2048]"),
                                  ("shared_ffn_hidden: abc\n",
                                   "shared_ffn_hidden = 'abc' is not a decimal integer"),
                                  ("dtype: fp64\n", "dtype = 'fp64' must be bf16 or fp32"),
                                  ("hidden: 1" + "0" * 400 + "\n", "must be in [1, 1048576]"),
                                  ("topk: 9\n", "topk = 9 exceeds num_experts = 8"),
                                  ("fp8: maybe\n", "fp8 = 'maybe' must be true or false"),
                                  ("fp8: true\ndtype: fp32\nalign_size: 16\n",
                                   "FP8 experts take bf16 rows and weights, not dtype = fp32"),
                                  ("hidden: 1000\nfp8: true\nalign_size: 16\n",
                                   "FP8 experts need hidden a multiple of 16, not 1000"),
                                  ("fp8: true\nalign_size: 8\n",
                                   "fp8 = true needs align_size a multiple of 16, got 8"),
                                  ("fp8_dispatch: true\n", "fp8_dispatch = true needs fp8 = true"),
                                  ("shared_ffn_hiden: 64\n", "unknown key 'shared_ffn_hiden'"),
                                  ("hidden:64\n", "expected 'key: value', got 'hidden:64'"),
                                  ("{hidden: 32, topk: 2}\n",
                                   "a flow mapping, a list or a second document"),
                                  ("topk: 2\n---\n", "got '---'"),
                                  ("capacity_factor: 2e4\n", "capacity_factor = 2e4 is past 10000"),
                                  ("pad_to_capacity: true\n",
                                   "pad_to_capacity = true needs capacity_factor"),
                                  ("drop_policy: probs\n",
                                   "drop_policy = probs needs capacity_factor"),
                                  ("capacity_factor: nan\n",
                                   "capacity_factor = 'nan' is not a finite number"),
                                  ("scaling_factor: inf\n",
                                   "scaling_factor = 'inf' is not a finite number"),
                                  ("exchange_chunks: -3\n",
                                   "exchange_chunks = '-3' is not a decimal integer in [0, 1024]"),
                                  ("ep_transport: bogus\n",
                                   "ep_transport = 'bogus' must be auto or peer or nccl or copy"),
                                  ("score_function: banana\n",
                                   "score_function = 'banana' must be softmax or sigmoid"),
                                  ("ep: -4\n", "ep = '-4' is not a decimal integer")):
                bad = pathlib.Path(d) / "bad.yaml"
                lines = {"hidden": "1024", "ffn_hidden": "512", "num_experts": "8", "topk": "2"}
                body = "".join(f"{k}: {v}\n" for k, v in lines.items()
                               if k != text.split(":")[0])
                bad.write_text(text + body)
                r = subprocess.run([sys.executable, script, str(bad)], capture_output=True,
                                   text=True)
                self.assertNotEqual(r.returncode, 0, text)
                self.assertIn(message, r.stderr)
            # What the layer's loader takes: a byte-order mark, quoted keys, a signed integer;
            # and the FP8 options where the config turns FP8 on.
            fp8 = pathlib.Path(d) / "fp8.yaml"
            fp8.write_text("\ufeffhidden: +1024\n\"ffn_hidden\": 512\n'num_experts': 8\ntopk: 2\n"
                           "fp8: true\nalign_size: 16\n", encoding="utf-8")
            r = subprocess.run([sys.executable, script, str(fp8), "--micro-batches", "4",
                                "--fp8-speedup", "1.5", "--ep", "1"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("FP8 experts at 1.5x, the weights quantized once in 4 step(s)", r.stdout)
            r = subprocess.run([sys.executable, script, str(config), "--ep", "1", "2"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            rows = [line.split() for line in r.stdout.splitlines()[2:]]
            self.assertEqual([row[0] for row in rows], ["1", "2"])
            self.assertTrue(all(math.isfinite(float(v)) for row in rows for v in row[2:7]))
            # Rows the model cannot price say why, beside those it can; a device is no config.
            r = subprocess.run([sys.executable, script, str(config), "--imbalance", "1.5",
                                "--ep", "1", "2", "3"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("imbalance 1.5 exceeds the EP", r.stdout)
            self.assertIn("EP does not divide the 8 experts", r.stdout)
            r = subprocess.run([sys.executable, script, "/dev/zero"], capture_output=True,
                               text=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("/dev/zero: not a regular file", r.stderr)
            # The config's exchange and chunks are priced unless the command line names others.
            nccl = pathlib.Path(d) / "nccl.yaml"
            nccl.write_text("hidden: 1024\nffn_hidden: 512\nnum_experts: 8\ntopk: 2\n"
                            "ep_transport: nccl\nexchange_chunks: 2\n")
            r = subprocess.run([sys.executable, script, str(nccl), "--ep", "4"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("(nccl exchanges at 60% of them)", r.stdout)
            self.assertEqual(r.stdout.splitlines()[2].split()[6], "2")  # the chunks column


if __name__ == "__main__":
    unittest.main()
