"""What the plot scripts share: reading their inputs with one-line errors, and matplotlib's pyplot,
drawing to files, imported once the inputs are read, so that --help, argument errors and bad
inputs need no matplotlib."""
import json
import math
import os


def read_json(path, program):
    """The JSON value in `path`, or an exit naming the file and what is wrong with it."""
    if not os.path.exists(path):
        raise SystemExit(f"{program}: {path}: no such file")
    if not os.path.isfile(path):  # a device or a pipe would be read without end
        raise SystemExit(f"{program}: {path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:  # ValueError: bad JSON, bad UTF-8, 4300+ digits
        raise SystemExit(f"{program}: {path}: {error}")
    except RecursionError:
        raise SystemExit(f"{program}: {path}: nested too deep to be a benchmark's results")


# Formats matplotlib writes, by the output's extension.
IMAGE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp",
                 "pgf", "raw", "rgba")


def shown(value):
    """`value` for a message: an integer of more than 30 digits cut to its first 12."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"{str(value)[:12]}..."
    return repr(value)


def number(value, where, program, positive=False, at_least=None, at_most=None):
    """`value` as a finite float (above 0, or within [at_least, at_most], where asked), or an
    exit naming where it came from. A JSON integer too large for a float is not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SystemExit(f"{program}: {where} = {value!r} is not a finite number")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise SystemExit(f"{program}: {where} = {shown(value)} is not a finite number")
    if positive and as_float <= 0:
        raise SystemExit(f"{program}: {where} = {shown(value)} must be above 0")
    if at_least is not None and as_float < at_least:
        raise SystemExit(f"{program}: {where} = {shown(value)} must be at least {at_least:g}")
    if at_most is not None and as_float > at_most:
        raise SystemExit(f"{program}: {where} = {shown(value)} must be at most {at_most:g}")
    return as_float


def label(text):
    """`text` shown as written in a plot: matplotlib reads $...$ as math."""
    return str(text).replace("$", r"\$")


def image_file(path, program):
    """Exits unless `path` names a file (not a folder) of a format matplotlib writes, in a
    folder a file can be written into."""
    if os.path.isdir(path):
        raise SystemExit(f"{program}: {path!r} is a folder; name the image file")
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in IMAGE_FORMATS:
        raise SystemExit(f"{program}: {path!r}: the image's name must end in one of "
                         f".{', .'.join(IMAGE_FORMATS)}")
    writable_folder(os.path.dirname(os.path.abspath(path)), program)


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
