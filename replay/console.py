"""Printing rich renderables: piped output gets a wide console instead of rich's default 80 columns."""

from __future__ import annotations

from rich.console import Console

from reel.runtime.fit_tables import fit


def print_view(renderable: object, console: Console | None = None) -> None:
    """On a terminal, tables fit its width by hiding columns (runtime/fit_tables.py), never cutting a number."""
    console = console or Console()
    console = console if console.is_terminal else Console(width=260)
    console.print(fit(renderable, console))
