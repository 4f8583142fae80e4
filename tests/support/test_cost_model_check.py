#!/usr/bin/env python3
"""Checks scripts/cost_model_check.py: it sets the model beside moe_bench's --json reports as
docs/design.md's tables do (dropless and capacity mode), fails a point that misses by more than
its limit, and names a report it cannot read."""
import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cost_model import (ROOT, SCRIPTS, capacity_points, cost_model,  # noqa: E402
                             measured_points, rates)


def report(**overrides):
    """A moe_bench --json report's fields that cost_model_check.py reads: the 2 × H200 copy
    exchange row of design.md's table (deepseek-v3, EP 2, one chunk, shared experts in series)."""
    fields = {"config_file": "deepseek-v3.yaml", "tokens_per_gpu": 8192, "ep": 2,
              "ep_transport": "copy", "exchange_chunks": 1, "total_ms": 42.81,
              "grad_dtype": "fp32", "shared_ffn_hidden": 2048, "fp8": False,
              "fp8_dispatch": False, "micro_batches": 1, "capacity_factor": 0.0,
              "device": "NVIDIA H200"}
    fields.update(overrides)
    return fields


class CostModelCheck(unittest.TestCase):
    """scripts/cost_model_check.py sets the model beside moe_bench's reports as design.md's table
    does, and names a report it cannot read."""

    def run_check(self, *reports, limit=None):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, r in enumerate(reports):
                path = pathlib.Path(d) / f"r{i}.json"
                path.write_text(r if isinstance(r, str) else json.dumps(r))
                paths.append(str(path))
            command = [sys.executable, str(SCRIPTS / "cost_model_check.py"), *paths]
            if limit is not None:
                command += ["--limit", str(limit)]
            done = subprocess.run(command, capture_output=True, text=True)
            return done.returncode, done.stdout.replace(d + "/", ""), done.stderr

    def test_a_report_prices_as_the_designs_table_row(self):
        # (config, EP, exchange, shared experts, measured) → (predicted, error)
        table = {tuple(row[1:6]): row[6:] for row in measured_points()}
        code, out, err = self.run_check(report(), report(shared_ffn_hidden=0, total_ms=39.59),
                                        report(ep_transport="nccl", exchange_chunks=4,
                                               total_ms=42.21))
        self.assertEqual(code, 0, err)
        rows = [[cell.strip() for cell in line.strip("|").split("|")]
                for line in out.splitlines()[2:]]
        self.assertEqual(len(rows), 3)
        for row in rows:
            with self.subTest(row=row):
                self.assertEqual(row[6:8], table[tuple(row[1:6])])
                self.assertEqual(row[8], "—")  # dropless

    def test_a_report_that_kept_the_experts_input_prices_four_peer_exchanges(self):
        # Over the peer exchange the backward stores x again (a fifth exchange) unless the
        # experts' input was kept: the report's keep_expert_input decides, not the config's.
        peer = dict(ep_transport="peer", total_ms=40.0)
        code, out, err = self.run_check(report(**peer), report(**peer, keep_expert_input=True))
        self.assertEqual(code, 0, err)
        predicted = [float(line.strip("|").split("|")[6]) for line in out.splitlines()[2:]]
        config = cost_model.read_config(str(ROOT / "configs" / "deepseek-v3.yaml"))
        want = [cost_model.predict({**config, "keep_expert_input": keep}, 8192, 2,
                                   rates(transport="peer"))["overlap_ms"]
                for keep in ("false", "true")]
        self.assertEqual(predicted, [round(w, 2) for w in want])
        self.assertLess(predicted[1], predicted[0])
        code, _, err = self.run_check(report(keep_expert_input="yes"))
        self.assertEqual(code, 2)
        self.assertIn("'keep_expert_input' is 'yes', not true or false", err)

    def test_capacity_mode_prices_as_the_designs_capacity_table_and_a_miss_fails(self):
        # The 2 × H200 rows of design.md's capacity table, as moe_bench reports them.
        table = {(row[1], row[5]): row[6:] for row in capacity_points() if row[2] == "2"}
        fixed = dict(ep_transport="nccl", exchange_chunks=4, pad_to_capacity=True)
        code, out, err = self.run_check(
            report(**fixed, capacity_factor=1.25, total_ms=48.206),
            report(**fixed, config_file="qwen3-30b-a3b.yaml", shared_ffn_hidden=0,
                   capacity_factor=1.0, total_ms=5.799))
        self.assertEqual(code, 0, err)
        rows = [[cell.strip() for cell in line.strip("|").split("|")]
                for line in out.splitlines()[2:]]
        self.assertEqual([row[8] for row in rows], ["1.25, padded", "1, padded"])
        for row in rows:
            with self.subTest(row=row):
                predicted, error = table[(row[1], row[8])][1:]
                self.assertEqual(row[6:8], [predicted, error])
        # The run's align_size sets C: factor 0.8 gives 410 rows an expert, which a run aligned
        # to 128 pads to factor 1's 512.
        code, out, err = self.run_check(
            report(**fixed, config_file="qwen3-30b-a3b.yaml", shared_ffn_hidden=0,
                   capacity_factor=0.8, total_ms=5.799, align_size=128),
            report(**fixed, config_file="qwen3-30b-a3b.yaml", shared_ffn_hidden=0,
                   capacity_factor=1.0, total_ms=5.799))
        self.assertEqual(code, 0, err)
        predicted = [line.split("|")[7] for line in out.splitlines()[2:]]
        self.assertEqual(predicted[0], predicted[1])
        # A capacity report from before moe_bench named pad_to_capacity: no fixed blocks.
        code, out, err = self.run_check(report(capacity_factor=1.25))
        self.assertEqual(code, 0, err)
        self.assertIn("| 1.25 |", out)
        # Without fixed blocks the capacity caps the busiest GPU: at factor 4 nothing changes.
        code, out, err = self.run_check(report(capacity_factor=4.0, pad_to_capacity=False),
                                        report())
        self.assertEqual(code, 0, err)
        predicted = [line.split("|")[7] for line in out.splitlines()[2:]]
        self.assertEqual(predicted[0], predicted[1])
        code, out, err = self.run_check(report(total_ms=30.0))
        self.assertEqual(code, 1)
        self.assertIn("| +39.4%, beyond 15% |", out)
        self.assertIn("1 of 1 points miss by more than 15%", err)
        code, out, err = self.run_check(report(total_ms=30.0), limit=0.5)
        self.assertEqual(code, 0, err)

    def test_a_report_it_cannot_read_is_named(self):
        fields = report()
        del fields["ep"]
        for bad, said in ((fields, "r1.json: no 'ep'"),
                          (report(ep=True), "'ep' is True, not a whole number"),
                          (report(tokens_per_gpu=8192.5),
                           "'tokens_per_gpu' is 8192.5, not a whole number"),
                          (json.dumps(report()).replace('"ep": 2', '"ep": 1' + "0" * 400),
                           "'ep' is 1000000000000000000000000000000"),
                          (report(total_ms=-1), "'total_ms' = -1 is no step time"),
                          (report(total_ms=1e-300), "'total_ms' = 1e-300 is no step time"),
                          (report(capacity_factor=-1), "'capacity_factor' = -1 is outside"),
                          (report(fp8_dispatch=True), "'fp8_dispatch' without 'fp8'"),
                          (report(align_size=-16), "'align_size' is -16, not a whole number"),
                          (report(pad_to_capacity=True),
                           "'pad_to_capacity' without capacity mode"),
                          (report(pad_to_capacity="yes", capacity_factor=1.0),
                           "'pad_to_capacity' is 'yes', not true or false"),
                          (report(pad_to_capacity=True, capacity_factor=1.0),
                           "fixed blocks (pad_to_capacity) over the copy exchange"),
                          (report(ep=1, ep_transport="mpi"), "'ep_transport' = 'mpi' is none of"),
                          (report(ep_transport="auto"), "'ep_transport' = 'auto' at EP 2"),
                          (report(config_file="../CMakeLists.txt"),
                           "config_file '../CMakeLists.txt' is not a config of configs/"),
                          (report(ep=3), "EP 3 does not divide the 256 experts"),
                          (report(grad_dtype="fp16"), "'grad_dtype' = 'fp16' is neither"),
                          ("[1, 2]", "not a moe_bench --json report (a JSON object)"),
                          ("{", "cannot be read as a moe_bench --json report")):
            with self.subTest(said=said):
                code, out, err = self.run_check(report(), bad)
                self.assertEqual(code, 2, err)
                self.assertIn(said, err)
                self.assertNotIn("Traceback", err)
                self.assertEqual(out, "")  # no half table before the error
        code, _, err = self.run_check(report(), limit="nan")
        self.assertEqual(code, 2)
        self.assertIn("--limit = nan must be in (0, 10]", err)


if __name__ == "__main__":
    unittest.main()
