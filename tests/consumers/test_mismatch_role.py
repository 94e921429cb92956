"""The mismatch role on a real Redis and a real run's log: what the bus lost, the log still gives it."""

from __future__ import annotations

import asyncio

import pytest

from reel.bus.events import MismatchSplit
from reel.consumers import mismatch
from reel.consumers.mismatch import MismatchRole
from reel.runtime.config.run import load
from rollout_setup import stream_events
from runbuilder import build_run


@pytest.mark.slow  # builds a run: ~15 s
def test_commits_trimmed_before_the_role_read_them_are_split_from_the_log(redis_url: str, run_name: str,
                                                                          tmp_path, monkeypatch) -> None:
    """A lagging role can find commits already trimmed from the bus (the archiver and trainer read them):
    it learns them from the log once caught up with the bus, splits them, and finishes at the last step."""
    monkeypatch.setattr(mismatch, "LOG_SYNC_S", 0.2)
    run_dir = build_run(tmp_path / "run", {"run": {"name": run_name}}, split="none")
    config = load(run_dir / "config.toml")
    hidden = run_dir.parent / "log-later"
    (run_dir / "log").rename(hidden)  # nothing logged yet when the role starts, and the bus holds nothing
    role = MismatchRole(run_dir, redis_url, config)
    hidden.rename(run_dir / "log")  # the archiver logged the whole run; the bus was trimmed before the role read it
    asyncio.run(asyncio.wait_for(role.run(asyncio.Event()), 60))
    assert role.finished
    splits = [e for e in asyncio.run(stream_events(redis_url, run_name, "steps")) if isinstance(e, MismatchSplit)]
    assert sorted(e.step for e in splits) == list(range(1, config.run.steps + 1))
