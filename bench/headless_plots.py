"""matplotlib's pyplot, drawing to files, for the plot scripts: imported once their arguments are
read, so that --help and argument errors need no matplotlib."""


def pyplot(program):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{program}: needs matplotlib (python3 -m pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot
    return matplotlib.pyplot
