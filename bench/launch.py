"""What bench/compare_layer.py and bench/scaling.py share: mpirun with what every run on the GPU
machine needs, and the checks of their arguments, made before anything runs."""
import argparse
import os
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
