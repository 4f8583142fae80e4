"""What bench/compare_layer.py and bench/scaling.py share: mpirun with what every run on the GPU
machine needs, and the checks of their arguments, made before anything runs."""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun(ranks, command, timeout):
    """(exit status, stdout + stderr) of `command` on `ranks` ranks: never NVLink multicast, and
    as root where the machine runs its commands as root (Open MPI refuses that unless told)."""
    launcher = ["mpirun", "-np", str(ranks), "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE=0"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(launcher + command, capture_output=True, text=True, timeout=timeout,
                            env=env)
    return result.returncode, result.stdout + result.stderr


def require_mpirun():
    """Exits naming mpirun where it is not on PATH: every run goes through it."""
    if shutil.which("mpirun") is None:
        sys.exit("error: mpirun is not on PATH (Open MPI launches every run, one rank a GPU)")


def read_report(path, numbers=("total_ms",), tables=()):
    """A run's JSON report, or the reason it is none as a string: an object whose `numbers` are
    finite numbers of at least 0 (total_ms above 0) and whose `tables` are objects of such
    numbers. A run that wrote a broken file fails as a run, not as a traceback later."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        return f"{path}: not a JSON report: {error}"
    if not isinstance(report, dict):
        return f"{path}: not a JSON object"

    def number(value):  # finite and at least 0
        return not isinstance(value, bool) and isinstance(value, (int, float)) and \
            math.isfinite(value) and value >= 0

    for name in numbers:
        value = report.get(name)
        if not number(value) or (name == "total_ms" and value == 0):
            least = "above" if name == "total_ms" else "at least"
            return f"{path}: '{name}' is {value!r}, not a number {least} 0"
    for name in tables:
        table = report.get(name)
        if not isinstance(table, dict) or not all(number(v) for v in table.values()):
            return f"{path}: '{name}' is no object of numbers"
    return report


def refuse_repeats(parser, option, values):
    """argparse's error for a value given twice: each names one run, whose files the second would
    write over."""
    for value in values or []:
        if values.count(value) > 1:
            parser.error(f"{option} {value} is given twice: each is one run")


def count_in(low, high):
    """An argparse type: a decimal whole number in [low, high]."""
    def parse(text):
        # ASCII digits only: str.isdigit also takes '²' (which int() refuses) and other scripts'
        # digits (which it reads).
        if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0") or \
                len(text) > 20 or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number in [{low}, {high}]")
        return int(text)
    return parse


def config_name(text):
    """An argparse type: the name of a config in configs/ (mixtral-8x7b, not the file)."""
    # A plain name only: a path would point the output files' names outside --out.
    if not text or os.sep in text or text.startswith(".") or \
            not os.path.isfile(os.path.join(ROOT, "configs", text + ".yaml")):
        names = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))
        raise argparse.ArgumentTypeError(f"'{text}' is none of configs/: {', '.join(names)}")
    return text


def require_built(build, *targets):
    """Exits naming the first of `targets` (paths under the build folder) that is not there."""
    for target in targets:
        path = os.path.join(build, target)
        if not os.access(path, os.X_OK):
            sys.exit(f"error: {path} is not built (--build {build})")


def output_folder(path):
    """Creates the --out folder, or exits naming it and why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        sys.exit(f"error: --out '{path}': {error.strerror}")
