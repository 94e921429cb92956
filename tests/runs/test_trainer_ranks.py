"""The trainer as one logical trainer over 2 ranks (torchrun, gloo): rank 1 is SIGKILLed mid-run,
the group stops as a whole, and a restarted group resumes from its DCP checkpoint; the log's
audit finds every step committed once and no group trained twice or lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reel.bus.events import StepCommitted, decode, stream_key
from runbuilder import TINY_MODEL_TOML
from reel.runtime.config import run as config_mod
from reel.runtime.train.torchrun import torchrun_argv
from reel.runtime.train.initial_policy import ensure_initial_policy
from test_trainer_crash import CONFIG, _groups, _publish
from reel.producers.warmstart import warm_start

pytestmark = pytest.mark.slow
STEPS = 4


def _trainer_group(run_dir: Path, url: str) -> list[str]:
    return [sys.executable, *torchrun_argv(2), "role", "trainer", "--run", str(run_dir),
            "--bus", url]


def _commits(client: redis.Redis, run: str) -> list[StepCommitted]:
    events = [decode(f[b"e"]) for _, f in client.xrange(stream_key(run, "steps"))]
    return [e for e in events if isinstance(e, StepCommitted)]


def test_kill_rank_1_then_resume_trains_every_group_once(tmp_path: Path, redis_url: str, run_name: str) -> None:
    run_dir = tmp_path / "run"
    for sub in ("log", "blobs", "roles"):
        (run_dir / sub).mkdir(parents=True)
    text = CONFIG.format(name=run_name, model=TINY_MODEL_TOML).replace("steps = 3", f"steps = {STEPS}")
    (run_dir / "config.toml").write_text(text + "ranks = 2\n")
    ensure_initial_policy(run_dir, config_mod.load(run_dir / "config.toml"), warm_start)
    groups = [e for pair in _groups(run_dir, run_name) for e in pair]  # 8 groups, 2 per step
    client = redis.Redis.from_url(redis_url)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    asyncio.run(_publish(redis_url, groups[:8]))  # the groups of steps 1 and 2
    first = subprocess.Popen(_trainer_group(run_dir, redis_url), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(_commits(client, run_name)) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        asyncio.run(_publish(redis_url, groups[8:]))  # step 3 starts ...
        os.kill(int((run_dir / "roles" / "trainer.rank1.pid").read_text()), signal.SIGKILL)  # ... and rank 1 dies
        out = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, out[-3000:]  # the whole group stopped
    stopped_at = len(_commits(client, run_name))
    assert stopped_at < STEPS

    resumed = subprocess.run(_trainer_group(run_dir, redis_url), env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr or stopped_at == 2
    commits = _commits(client, run_name)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    assert all(c.world_size == 2 for c in commits)
    trained = [g for c in commits for g in c.groups] + [d.group_id for c in commits for d in c.dropped]
    assert len(trained) == len(set(trained)) == 8, "a group was trained twice or lost"
    assert commits[1].checkpoint is not None  # step 2's DCP checkpoint is what the restart resumed from
    assert (run_dir / "checkpoints" / "step-000002").is_dir()
