"""docs' module map (reference/modules.md): every package and module of Reel with the first line of its
docstring, generated when the site is built (ops/docs_hooks.py) so it cannot drift from the tree."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

# The top-level folders in data-flow order (DESIGN.md): the bus, the two sides, what both share, the log's readers.
PACKAGES = ("reel.bus", "reel.producers", "reel.consumers", "reel.runtime", "reel.replay")


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _folder(name: str) -> str:
    return name.removeprefix("reel.").replace(".", "/") + "/"


def entries() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """[(folder, its docstring's first line, [(module file, its first line)])], packages before their modules."""
    out = []
    for top in PACKAGES:
        todo = [top]
        while todo:
            name = todo.pop(0)
            package = importlib.import_module(name)
            root = Path(package.__path__[0])
            modules, subpackages = [], []
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
                if info.ispkg:
                    subpackages.append(f"{name}.{info.name}")
                else:
                    modules.append((f"{info.name}.py", _first_line(root / f"{info.name}.py")))
            out.append((_folder(name), _first_line(root / "__init__.py"), modules))
            todo[:0] = subpackages
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe in a docstring would end the table cell


def markdown() -> str:
    lines = ["# Module map", "",
             "Every folder and module of Reel with the first line of its docstring, generated from the tree "
             "when this site is built. The folders follow the data flow: producers → bus → consumers; "
             "runtime/ is shared (its core imports bus/ only; launch/ and bench/ start everything); "
             "replay/ reads the log.", ""]
    for folder, summary, modules in entries():
        lines += [f"## `{folder}`", "", summary or "", ""] if summary else [f"## `{folder}`", ""]
        if modules:
            lines += ["| module | what it is |", "|---|---|"]
            lines += [f"| `{module}` | {_cell(line)} |" for module, line in modules]
            lines.append("")
    return "\n".join(lines)
