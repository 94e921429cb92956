"""The per-run API key of the `vllm serve` servers Reel starts: RUN_DIR/vllm_api_key, mode 0600.

Made once per run (the first launcher to ask writes it, O_EXCL), handed to the servers and the
rollout workers through VLLM_API_KEY in their environment, never through argv; the servers require
it on every route (producers/vllm_auth.py), the HTTP engine sends it (producers/vllm_http.py).
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

from reel.runtime.config.keys import ConfigError

__all__ = ["KEY_FILE", "KEY_ENV", "run_api_key"]

KEY_FILE = "vllm_api_key"
KEY_ENV = "VLLM_API_KEY"  # read by vLLM, Reel's middleware and the HTTP engine alike


def run_api_key(run_dir: Path) -> str:
    """The run's key, made on first use."""
    path = Path(run_dir) / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    mode = path.lstat().st_mode
    if not stat.S_ISREG(mode) or mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} must be a regular file only its owner can read (mode {stat.filemode(mode)}); "
                          f"chmod 600 it or delete it to make a new key")
    return path.read_text().strip()


def main(argv: list[str]) -> int:
    """`python -m reel.runtime.launch.vllm_key RUN_DIR`: the key on stdout, for a job's environment."""
    try:
        print(run_api_key(Path(argv[0])))
    except (ConfigError, OSError) as exc:
        print(f"reel: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
