"""What `reel run --resume` may change, and where it resumes from.

A run's identity is its config.toml. Resuming with a config that differs names every key that
differs. Keys that only say how long to run or how to report (SAFE_TO_CHANGE) may change: the new
config becomes the run's config.toml and a ConfigChanged event records the change in the log, after
the last committed step. Any other key decides what the run trains, so a change is refused.
Raising `run.steps` is how a finished run is extended.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from reel.bus.errors import ReelError
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.runtime.config.sections import Config
from reel.runtime.launch.bus_loss import LossWindow, find_loss_window

__all__ = ["SAFE_TO_CHANGE", "ResumeError", "config_changes", "check_changes", "safe_keys", "last_committed_step",
           "record_resume"]

# Keys (or sections, ending in ".") whose change keeps every committed step valid.
SAFE_TO_CHANGE = ("run.steps", "log.", "sinks.", "eval.", "bus.ride_out_s", "run.stall_s")


class ResumeError(ReelError):
    """A --resume the run cannot take as asked."""


def config_changes(stored: Config, new: Config) -> dict[str, list[Any]]:
    """Every "section.key" whose value differs, -> [stored value, new value]."""
    old_keys, new_keys = _flat(msgspec.to_builtins(stored)), _flat(msgspec.to_builtins(new))
    return {key: [old_keys.get(key), new_keys.get(key)] for key in sorted(old_keys.keys() | new_keys.keys())
            if old_keys.get(key) != new_keys.get(key)}


def check_changes(config_path: Path, changes: dict[str, list[Any]], committed: int) -> None:
    """Refuse changes that are not safe, naming each one; run.steps may not go below what is committed."""
    unsafe = {key: values for key, values in changes.items() if not _safe(key)}
    if unsafe:
        listed = ", ".join(f"{key} ({old!r} -> {new!r})" for key, (old, new) in unsafe.items())
        raise ResumeError(
            f"--resume cannot change {listed}: they decide what the run trains. Put back the values of "
            f"{config_path} (or start a new run with another run.name or --out); only {safe_keys()} may change "
            f"on a resume")
    steps = changes.get("run.steps")
    if steps is not None and steps[1] < committed:
        raise ResumeError(f"run.steps = {steps[1]} is below the {committed} steps this run has already committed; "
                          f"set run.steps to at least {committed}")


def safe_keys() -> str:
    """SAFE_TO_CHANGE for messages: "run.steps, log.*, ..."."""
    return ", ".join(k + "*" if k.endswith(".") else k for k in SAFE_TO_CHANGE)


def last_committed_step(run_dir: Path) -> int:
    """The newest step in the run's log (0 before any)."""
    from reel.bus.events import StepCommitted

    try:
        with RunLog(run_dir, readonly=True) as run_log:
            if "steps" not in run_log.names():
                return 0
            return max((e.step for _, e in run_log.events("steps") if isinstance(e, StepCommitted)), default=0)
    except LogError:
        return 0  # no log yet: nothing was committed


def record_resume(run_dir: Path, url: str, config: Config, config_text: str, changes: dict[str, list[Any]],
                  after_step: int) -> LossWindow | None:
    """Log the resume and its changes (ConfigChanged on the control stream, `changes` maybe empty), then
    make `config_text` the run's config.toml when it changed a key. A ConfigChanged after a RunFinished
    means the run went on: screens read the run as running again, not as it last ended. Returns what
    Redis lost of the log (runtime/launch/bus_loss.py), found first: the ConfigChanged, newer than any
    lost entry, would hide a loss on the control stream.

    Before any role starts: every role reads config.toml when it starts, and a role's entry would hide a gap."""
    from reel.bus.events import ConfigChanged
    from reel.bus.seqs import recover_seq
    from reel.bus.streams import Publisher, connect

    async def publish() -> None:
        redis = connect(url)
        try:
            producer = "launcher:0"
            seq = await recover_seq(redis, run_dir, config.run.name, producer, ["control"], config.bus.partitions)
            publisher = Publisher(redis, config.run.name, producer, seq)
            await publisher.publish([publisher.stamp(ConfigChanged, config_toml=config_text, changed=changes,
                                                     after_step=after_step)])
        finally:
            await redis.aclose()

    window = find_loss_window(url, config.run.name, run_dir, config.bus.partitions)
    asyncio.run(publish())
    if changes:
        staging = run_dir / ".config.toml.new"
        staging.write_text(config_text)
        os.replace(staging, run_dir / "config.toml")
    return window


def _flat(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, dict) and not prefix:  # sections; dict-valued keys (env.options) stay whole
            out.update(_flat(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def _safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_TO_CHANGE)
