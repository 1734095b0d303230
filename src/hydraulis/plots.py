"""Plotting helpers every figure shares: matplotlib on Agg, a checked file name, an atomic save.

They sit below every module that draws (data statistics, benchmark reports,
the training report), so drawing never pulls in what is drawn.
"""

from __future__ import annotations

from pathlib import Path

from hydraulis.errors import HydraulisError
from hydraulis.files import OutputSet, check_output


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a HydraulisError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HydraulisError("plotting needs matplotlib: pip install 'hydraulis[cli]'") from None
    return plt


PLOT_FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: str | Path, what: str = "plot") -> Path:
    """A writable file name with a format matplotlib writes, checked before any work."""
    path = check_output(path, what)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise HydraulisError(f"{path}: a {what} file must end in {', '.join(PLOT_FORMATS)}")
    return path


def save_figure(fig, path: str | Path, dpi: float | str = 120) -> None:
    """Write through the atomic writer (a failed plot leaves no file); the figure is closed either way."""
    plt = pyplot()
    path = check_plot_path(path)
    try:
        with OutputSet() as outputs:
            fig.savefig(outputs.stage(path), dpi=dpi, format=path.suffix[1:].lower())
    finally:
        plt.close(fig)
