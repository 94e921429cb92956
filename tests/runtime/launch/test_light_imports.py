"""The processes that train nothing import no torch: importing it costs a process ~3 s of CPU on this
2-core machine (2026-12-05), paid by every `reel run` launcher and by every archiver and sink role of
every run (and of every whole-run test)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT = ["reel.runtime.launch.cli", "reel.runtime.launch.supervisor", "reel.runtime.launch.roles",
         "reel.consumers.archiver", "reel.consumers.sinks.cli"]


@pytest.mark.parametrize("module", LIGHT)
def test_module_imports_no_torch(module: str) -> None:
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", f"{module} imports torch"
