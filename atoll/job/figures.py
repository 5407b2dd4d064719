"""Where atoll's plots get matplotlib: :func:`pyplot`, imported when a figure is drawn, not at start-up."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (image files, no screen), imported on first use: importing it
    takes about a quarter of a second, which every rank and island process would otherwise pay at start-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
