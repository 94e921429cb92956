"""`--plot FILE`: checked before any analysis runs, so a typo costs nothing.

A figure is written at the end of a replay, bisect, compare or simulation that can take minutes;
a folder that does not exist or a suffix matplotlib cannot write would otherwise fail only then,
as a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["plot_problem"]


def plot_problem(plot: str) -> str | None:
    """Why `--plot plot` cannot be written (one sentence naming the fix), or None."""
    from matplotlib.backend_bases import FigureCanvasBase  # not pyplot: no backend is started

    path = Path(plot)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        return (f"--plot {plot}: cannot write a figure as {path.suffix or 'a file without a suffix'}; "
                f"end the name with one of {', '.join('.' + f for f in sorted(formats))} (e.g. .png)")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"--plot {plot}: the folder {folder} does not exist; create it or choose another path"
    if not os.access(folder, os.W_OK):
        return f"--plot {plot}: the folder {folder} is not writable; choose another path"
    if path.is_dir():
        return f"--plot {plot} is a directory; name a file in it, e.g. {path / 'figure.png'}"
    return None
