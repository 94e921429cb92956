"""Printing rich renderables: piped output gets a wide console instead of rich's default 80 columns."""

from __future__ import annotations

from rich.console import Console


def print_view(renderable: object) -> None:
    console = Console()
    (console if console.is_terminal else Console(width=260)).print(renderable)
