"""Env calls off the event loop (producers/tool_calls.py): slow tools wait side by side, a hung or
crashing tool is cut with its reason in the episode, concurrency is bounded; the worker's wall time
splits into engine busy, tool wait and idle (producers/time_split.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from reel.bus.events import WorkerStats
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.producers.envs import CharTokenizer, Continue, Finish
from reel.producers.envs.reverse_text import ReverseText
from reel.producers.episode import run_group
from reel.producers.rollout import RolloutWorker
from reel.producers.time_split import TimeSplit
from reel.producers.tool_calls import ToolCalls
from reel.runtime.model.config import MoEConfig
from reel.runtime.config.run import load
from reel.runtime.model.model import MoEModel
from rollout_setup import initial_model, make_run, publish_weights, stream_events, wait_for

TOK = CharTokenizer()


class SleepyTool(ReverseText):
    """Two model turns with one tool call between them that sleeps `seconds` (in a thread: a plain respond)."""

    max_turns = 2

    def __init__(self, seconds: float, fail: str = ""):
        super().__init__(TOK, min_len=3, max_len=3)
        self.seconds, self.fail = seconds, fail
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def respond(self, prompt, turns):
        if len(turns) > 1:
            return Finish(1.0)
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            time.sleep(self.seconds)
            if self.fail:
                raise ValueError(self.fail)
        finally:
            with self._lock:
                self.running -= 1
        return Continue(TOK.turn_ids("tool", "=ok;"), tool_call=True)


class AsyncSleepyTool(SleepyTool):
    """The same tool as a coroutine: awaited on the loop."""

    async def respond(self, prompt, turns):
        if len(turns) > 1:
            return Finish(1.0)
        await asyncio.sleep(self.seconds)
        return Continue(TOK.turn_ids("tool", "=ok;"), tool_call=True)


def _groups(env, calls: ToolCalls, groups: int, split: TimeSplit | None = None):
    torch.manual_seed(0)
    model = MoEModel(MoEConfig(vocab_size=TOK.vocab_size)).eval()

    async def go():
        async with BuiltinEngine(model, max_batch=64) as engine:
            params = [SamplingParams(n=8, max_tokens=3, stop_token_ids=TOK.stop_ids, seed=g) for g in range(groups)]
            prompts = [env.sample(random.Random(g)) for g in range(groups)]
            started = time.monotonic()
            done = await asyncio.gather(*(run_group(engine, env, p, q, calls, split) for p, q in zip(prompts, params)))
            return done, time.monotonic() - started, engine.stats().busy_s

    try:
        return asyncio.run(go())
    finally:
        calls.close()


@pytest.mark.parametrize("tool", [SleepyTool, AsyncSleepyTool])
def test_64_episodes_whose_tool_sleeps_1_s_wait_side_by_side(tool) -> None:
    groups, wall, _ = _groups(tool(1.0), ToolCalls(64, 30.0), groups=8)
    episodes = [e for g in groups for e in g]
    assert len(episodes) == 64 and all(e.tool_calls == 1 and e.reward == 1.0 and not e.env_error for e in episodes)
    assert wall < 20.0, f"64 one-second tool calls took {wall:.1f} s: they ran one after another (64 s)"


def test_tool_concurrency_bounds_the_calls_at_once() -> None:
    env = SleepyTool(0.2)
    groups, wall, _ = _groups(env, ToolCalls(3, 30.0), groups=2)
    assert env.most_running == 3 and all(e.reward == 1.0 for g in groups for e in g)
    assert wall >= 16 * 0.2 / 3  # 16 calls, three at a time


@pytest.mark.parametrize("tool", [SleepyTool, AsyncSleepyTool])
def test_a_hung_tool_is_cut_at_its_timeout_with_the_reason_and_the_group_goes_on(tool) -> None:
    groups, wall, _ = _groups(tool(3.0), ToolCalls(16, 0.3), groups=1)
    (episodes,) = groups
    assert len(episodes) == 8 and wall < 3.0
    for e in episodes:
        assert e.reward == 0.0 and e.tool_calls == 0 and len(e.turn_lengths) == 1
        assert e.env_error == "env reverse_text did not answer model turn 1 within rollout.tool_timeout_s = 0.3 s"
        assert e.sample().env_error == e.env_error  # into the trajectory


def test_a_crashing_tool_ends_its_episode_with_the_error() -> None:
    (episodes,), _, _ = _groups(SleepyTool(0.0, fail="sandbox exited 137"), ToolCalls(4, 10.0), groups=1)
    assert [e.env_error for e in episodes] == ["env reverse_text failed on model turn 1: ValueError: "
                                               "sandbox exited 137"] * 8
    assert all(e.reward == 0.0 for e in episodes)


def test_wall_time_splits_into_engine_busy_tool_wait_and_idle() -> None:
    split = TimeSplit()
    time.sleep(0.3)  # idle: nothing admitted yet
    _, _, busy = _groups(AsyncSleepyTool(0.5), ToolCalls(64, 10.0), groups=2, split=split)
    wall, tool_wait, idle = split.totals()
    assert 0.45 <= tool_wait <= 0.5 + 0.25 * wall  # the one round of tool calls, side by side
    assert idle >= 0.3
    assert abs(busy + tool_wait + idle - wall) <= 0.1 * wall, (busy, tool_wait, idle, wall)


SLEEPY_SOURCE = '''
import asyncio
from reel.producers.envs import Continue, Finish
from reel.producers.envs.reverse_text import ReverseText


class Sleepy(ReverseText):
    max_turns = 2

    async def respond(self, prompt, turns):
        if len(turns) > 1:
            return Finish(self.reward(prompt, turns[-1]))
        await asyncio.sleep(0.4)
        return Continue(self.tokenizer.turn_ids("tool", "=ok;"), tool_call=True)


def make(section, tokenizer, max_tokens):
    return Sleepy(tokenizer, min_len=3, max_len=3)
'''


async def test_worker_stats_say_where_the_wall_time_went(redis_url: str, run_name: str, tmp_path, monkeypatch) -> None:
    (tmp_path / "user_sleepy_env.py").write_text(SLEEPY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = make_run(tmp_path, run_name, async_level=0, env='[env]\nname = "user_sleepy_env:make"\n')
    started = time.monotonic()
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
    groups = await wait_for(redis_url, run_name, 2)  # one round, then the synchronous gate holds the worker
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(task, 20)
    elapsed = time.monotonic() - started

    assert all(s.tool_calls == 1 and s.env_spans for g in groups for s in g.samples)
    stats = [e for e in await stream_events(redis_url, run_name, "control") if isinstance(e, WorkerStats)]
    last = stats[-1]
    # One round: two groups' tool calls side by side, 0.4 s, with the engine idle (more when the tool
    # calls of the two groups did not overlap); then held by the gate, idle.
    assert 0.35 <= last.tool_wait_s <= 1.0 and last.idle_s >= 0.8 and last.busy_s > 0
    total = last.busy_s + last.tool_wait_s + last.idle_s
    assert elapsed - 1.0 <= total <= elapsed, (last.busy_s, last.tool_wait_s, last.idle_s, elapsed)
    assert [s.busy_s + s.tool_wait_s + s.idle_s for s in stats] == sorted(s.busy_s + s.tool_wait_s + s.idle_s
                                                                          for s in stats)
