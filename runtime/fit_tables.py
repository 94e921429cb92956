"""Tables that fit the terminal without cutting a number.

Rich shrinks a table wider than the console by cutting cells to `0.…` or `1.915e…`, which makes
1.9e-02 and 1.9e-13 look the same. Instead, a table that does not fit loses whole columns from the
right (the leftmost, the row's key, always stays) and says which, so every number shown is whole.
Column headers may still wrap: only cells hold numbers.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table

__all__ = ["fit"]


def fit(renderable: object, console: Console) -> object:
    """`renderable` with each table in it (itself, or inside a Group) narrowed to the console's width."""
    if isinstance(renderable, Table):
        _fit_table(renderable, console)
    elif isinstance(renderable, Group):
        for part in renderable.renderables:
            fit(part, console)
    return renderable


def _fit_table(table: Table, console: Console) -> None:
    for column in table.columns:
        column.overflow = "fold"  # a column still too narrow folds onto a second line, never "…"
        column.no_wrap = True
    hidden = []
    while len(table.columns) > 1 and _natural_width(table, console) > console.width:
        hidden.insert(0, str(table.columns.pop().header))
    if hidden:
        note = f"{len(hidden)} columns hidden to fit {console.width} columns: {', '.join(hidden)} (widen the " \
               f"terminal, or --json for every figure)"
        table.caption = f"{table.caption}; {note}" if table.caption else note
        table.caption_justify = "left"


def _natural_width(table: Table, console: Console) -> int:
    """The width the table takes when nothing is shrunk."""
    return Measurement.get(console, console.options.update(width=1 << 16), table).maximum
