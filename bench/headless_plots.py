"""What the plot scripts share: reading their inputs with one-line errors, and matplotlib's pyplot,
drawing to files, imported once the inputs are read, so that --help, argument errors and bad
inputs need no matplotlib."""
import json
import math
import os


def read_json(path, program):
    """The JSON value in `path`, or an exit naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SystemExit(f"{program}: {path}: {error}")


def number(value, where, program, positive=False):
    """`value` as a finite float (positive where asked), or an exit naming where it came from."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SystemExit(f"{program}: {where} = {value!r} is not a finite number")
    if positive and value <= 0:
        raise SystemExit(f"{program}: {where} = {value!r} must be above 0")
    return float(value)


def writable_folder(path, program):
    """Exits unless `path` is a folder a file can be written into: checked before any input is
    read, so that a long run's plot does not fail at its last step."""
    if not os.path.isdir(path):
        raise SystemExit(f"{program}: {path!r} is not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SystemExit(f"{program}: {path!r}: no permission to write there")


def pyplot(program):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{program}: needs matplotlib (python3 -m pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot
    return matplotlib.pyplot
