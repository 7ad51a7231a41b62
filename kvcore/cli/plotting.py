"""Figures for ``kvcore bench --plot`` and ``kvcore layout --plot``.

matplotlib is optional (``pip install 'kvcore[plot]'``) and imported only when a plot is
asked for. Figures are built with :class:`matplotlib.figure.Figure` directly, not pyplot, so
plotting touches no global state of the caller's process and needs no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["check_plot_path", "new_figure", "save_figure"]


def check_plot_path(path: str | Path) -> Path:
    """Check before any work that ``path`` can receive a PNG and matplotlib is installed.

    Raises ``ValueError`` naming ``--plot`` and the fix (the CLI reports it as a bad
    argument).
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot {path}: the file name must end in .png")
    if not path.parent.is_dir():
        raise ValueError(f"--plot {path}: directory {path.parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed "
                         "(pip install 'kvcore[plot]')") from None
    return path


def new_figure(width: float, height: float) -> Figure:
    """An empty figure of ``width`` x ``height`` inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG into ``path`` (see :func:`check_plot_path`); returns the path."""
    path = check_plot_path(path)
    fig.savefig(path, dpi=110)
    return path
