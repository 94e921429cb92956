"""examples/reverse_text.toml cut short for the liveness tests: a 5-step warm-start and a stall bound."""

import re
from pathlib import Path

from paths import REPO


def reverse_text_with_stall_bound(tmp_path: Path, *, steps: int, stall_s: int) -> Path:
    """The example for `steps` steps with run.stall_s = `stall_s`, written to tmp_path; returns the file."""
    text = (REPO / "examples" / "reverse_text.toml").read_text()
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r"(?m)^warmup_steps = \d+", "warmup_steps = 5", text)
    text = re.sub(r"(?m)^seed = 0$", f"seed = 0\nstall_s = {stall_s}", text, count=1)
    path = tmp_path / "reverse_text.toml"
    path.write_text(text)
    return path
