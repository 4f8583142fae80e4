"""What the plot scripts share: reading their inputs with one-line errors, and matplotlib's pyplot,
drawing to files, imported once the inputs are read, so that --help, argument errors and bad
inputs need no matplotlib."""
import json


def read_json(path, program):
    """The JSON value in `path`, or an exit naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SystemExit(f"{program}: {path}: {error}")


def pyplot(program):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{program}: needs matplotlib (python3 -m pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot
    return matplotlib.pyplot
