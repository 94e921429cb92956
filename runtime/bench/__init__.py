"""`reel bench NAME`: every benchmark, one module each, and their shared harness in common/.

A bench module is `NAME.py` here (`log_seek.py` is `reel bench log-seek`, `async_.py` is `reel
bench async`) with a docstring whose first line is its help and `run(args) -> int`, which prints
one JSON line: the figures and a `ratio` against a baseline measured in the same run. Adding a
bench means adding a module; `reel bench --help` lists them from here without importing them (no
torch for --help). common/ holds what several benches use: the bus pipeline, pinning and timing,
peak memory. This package sits on the shell's floor: it may import everything it measures.
"""

from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path


def bench_modules() -> dict[str, str]:
    """{bench name: its help line}, read from the modules' docstrings."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            continue
        source = (Path(__path__[0]) / f"{info.name}.py").read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        line = doc.splitlines()[0] if doc else ""
        found[info.name.rstrip("_").replace("_", "-")] = re.sub(r"^`reel bench [^`]*`: ", "", line)
    return found


def module_of(name: str) -> str:
    """The import name of bench `name` (as `bench_modules` spells it)."""
    stem = name.replace("-", "_")
    return f"{__name__}.{stem}_" if stem in {"async"} else f"{__name__}.{stem}"
