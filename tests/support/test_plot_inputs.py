#!/usr/bin/env python3
"""bench/plot.py and bench/plot_train.py refuse bad inputs with one line naming the file, the
entry and the value, before they need matplotlib (so these run on any machine)."""
import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import plot_train  # noqa: E402


def run(script, *args):
    """The script's exit status and its output, both streams."""
    done = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


class PlotInputs(unittest.TestCase):
    def setUp(self):
        self.folder = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.folder.name)

    def tearDown(self):
        self.folder.cleanup()

    def write(self, name, content):
        path = self.dir / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    def assert_refused(self, said, script, *args):
        code, text = run(script, *args)
        self.assertNotEqual(code, 0, text)
        self.assertIn(said, text)
        self.assertNotIn("Traceback", text)

    def test_layer_plot_names_the_row_and_field(self):
        ours = {"total_ms": 3.0, "stages_ms": {"moe experts": 2.0}}
        cases = [
            ([{"ours": 1, "peer": 2}], "row 0: needs 'config' (a name) and 'ranks' (a count)"),
            ([{"config": "x", "ranks": 1, "ours": dict(ours, stages_ms=[1]), "peer": None}],
             "row 0: ours.stages_ms is [1], not stage times"),
            ([{"config": "x", "ranks": 1, "ours": ours, "peer": {"total_ms": 0}}],
             "row 0: peer.total_ms = 0 must be above 0"),
            ([{"config": "x", "ranks": 1, "ours": ours, "peer": {"total_ms": 2.0}},
              {"config": "y", "ranks": 2, "ours": ours, "peer_compiled": "fast"}],
             "row 1: 'peer_compiled' is 'fast', not a run's results"),
            ([{"config": "x", "ranks": 1, "ours": dict(ours, stages_ms={"gate": "slow"}),
               "peer": {"total_ms": 2.0}}], "row 0: ours.stages_ms['gate'] = 'slow' is not"),
        ]
        for rows, said in cases:
            with self.subTest(said=said):
                self.assert_refused(said, "plot.py", self.write("compare.json", rows),
                                    "--out", self.dir)
        self.assert_refused("is not a folder", "plot.py", self.write("compare.json", []),
                            "--out", self.dir / "missing")
        row = {"config": "x", "ranks": 1, "ours": ours, "peer": {"total_ms": 2.0}}
        for rows, said in [
            ([dict(row, ranks=-3)], "got 'x' and -3"),
            ([dict(row, ours=dict(ours, stages_ms={"gate": -1.0}))],
             "ours.stages_ms['gate'] = -1.0 must be at least 0"),
            ([dict(row, peer={"total_ms": 1e308})], "peer.total_ms = 1e+308 must be at most"),
            ([row] * 61, "61 results to draw; a plot holds at most 60"),
            ([dict(row, peer={"total_ms": 1e-320})], "peer.total_ms = 1e-320 must be at least"),
        ]:
            with self.subTest(said=said):
                self.assert_refused(said, "plot.py", self.write("compare.json", rows),
                                    "--out", self.dir)
        # A JSON integer no float holds, and nesting deeper than Python's recursion.
        self.assert_refused("ours.total_ms = 100000000000... is not a finite number", "plot.py",
                            self.write("big.json", '[{"config": "x", "ranks": 1, "ours": '
                                       '{"total_ms": 1' + "0" * 400 + ', "stages_ms": {}}, '
                                       '"peer": {"total_ms": 1}}]'), "--out", self.dir)
        self.assert_refused("Exceeds the limit (4300 digits)", "plot.py",
                            self.write("huge.json", '[{"ranks": 1' + "0" * 5000 + '}]'),
                            "--out", self.dir)
        self.assert_refused("nested too deep", "plot.py",
                            self.write("deep.json", "[" * 100000 + "]" * 100000), "--out", self.dir)
        # A device is no results file, and a folder where an image goes is refused before reading.
        self.assert_refused("/dev/zero: not a regular file", "plot.py", "/dev/zero",
                            "--out", self.dir)
        (self.dir / "layer_stages.png").mkdir()
        self.assert_refused("layer_stages.png' is a folder", "plot.py",
                            self.write("compare.json", [row]), "--out", self.dir)

    def test_compare_layer_refuses_token_counts_before_any_gpu(self):
        # Argument errors come before PyTorch or a GPU is looked for.
        for args, said in ((["--tokens", "\u00b2"], "'\u00b2' is not a whole number in [1, "),
                           (["--tokens", "\uff11\uff10"], "is not a whole number in [1, "),
                           (["--tokens", "0"], "'0' is not a whole number in [1, 1073741824]"),
                           (["--tokens", "1024", "1024"],
                            "--tokens 1024 is given twice: each is one run"),
                           (["--configs", "small", "small"],
                            "--configs small is given twice: each is one run"),
                           (["--ranks", "1", "2", "1"], "--ranks 1 is given twice")):
            with self.subTest(args=args):
                code, text = run("compare_layer.py", *args)
                self.assertEqual(code, 2, text)
                self.assertIn(said, text)
                self.assertNotIn("Traceback", text)

    def test_training_plot_names_the_log_entry_and_value(self):
        cases = [
            ({"log": [1, 2]}, "log[0] is 1, not an object"),
            ({"log": [{"loss": 1.0}]}, "log[0].step = None is not a step number"),
            ({"log": [{"step": "abc", "loss": 1.0}]}, "log[0].step = 'abc' is not a step number"),
            ({"log": [{"step": 1.7, "loss": 1.0}]}, "log[0].step = 1.7 is not a step number"),
            ({"log": [{"step": 1, "loss": [1]}]}, "log[0].loss = [1] is not a finite number"),
        ]
        out = self.dir / "out.png"
        for report, said in cases:
            with self.subTest(said=said):
                self.assert_refused(said, "plot_train.py", "--out", out, "--metric", "loss",
                                    f"run={self.write('train.json', report)}")
        line = "step 10 loss {} x load max/mean {} per expert, 1.2 per EP rank\n"
        self.assert_refused("bad.txt:2: '1.5.3' is not a number", "plot_train.py", "--out", out,
                            f"run={self.write('bad.txt', line.format(1.0, 1.5) + line.format(1.0, '1.5.3'))}")
        zero = self.write("zero.txt", line.format(0, 1.5))
        self.assert_refused("zero.txt:1: loss = 0.0 must be above 0", "plot_train.py", "--out", out,
                            "--metric", "loss", f"base={zero}", f"other={zero}")
        self.assert_refused("is not a folder", "plot_train.py", "--out", self.dir / "no" / "o.png",
                            f"run={zero}")
        # A diverged run's "loss nan" line keeps its load, and names no loss.
        diverged = self.write("diverged.txt", line.format(1.0, 1.5) + line.format("nan", 3.5))
        self.assertEqual(plot_train.read_log(str(diverged), "imbalance"), ([10, 10], [1.5, 3.5]))
        self.assertEqual(plot_train.read_log(str(diverged), "loss"), ([10], [1.0]))
        self.assert_refused("huge.txt:1: loss = inf is not a finite number", "plot_train.py",
                            "--out", out, "--metric", "loss",
                            f"run={self.write('huge.txt', line.format('1e999', 1.5))}")
        self.assert_refused("log[0].dropped_fraction = 7 must be at most 1", "plot_train.py",
                            "--out", out, "--metric", "dropped",
                            f"run={self.write('d.json', {'log': [{'step': 1, 'dropped_fraction': 7}]})}")
        huge_step = self.write("s.json", '{"log": [{"step": 1' + "0" * 400 + ', "loss": 1}]}')
        self.assert_refused("log[0].step = 100000000000... is not a step number",
                            "plot_train.py", "--out", out, "--metric", "loss", f"run={huge_step}")
        long_step = self.write("long.txt", line.format(1.0, 1.5).replace("10", "1" + "0" * 5000))
        self.assert_refused("long.txt:1: step 100000000000... is not a step number",
                            "plot_train.py", "--out", out, f"run={long_step}")
        self.assert_refused("the image's name must end in one of .png", "plot_train.py",
                            "--out", self.dir / "a.xyz", f"run={zero}")
        self.assert_refused("is a folder; name the image file", "plot_train.py", "--out", self.dir,
                            f"run={zero}")


if __name__ == "__main__":
    unittest.main()
