"""Env turns off the event loop: each episode's `env.respond` waits alone, bounded and timed.

A rollout worker runs every episode of every group on one asyncio loop, next to the engine's
batching and the weight follower. An env's `respond` (its tool call, its reward) therefore must
never run on that loop: one slow tool would stall every episode, the engine and weight updates.

    respond is a coroutine function   awaited on the loop (it must itself await, not block)
    respond is a plain function       run on a bounded thread pool of rollout.tool_concurrency threads

Either way at most rollout.tool_concurrency calls run at once (the rest wait for a slot), and a
call that has not answered within rollout.tool_timeout_s of asking for its slot is cut: a coroutine
is cancelled; a thread cannot be, so it keeps its slot until it returns (calls queue behind hung
threads, and time out in turn, rather than the pool growing without bound). A cut call, or one that
raises, ends its episode with reward 0 and the reason in Sample.env_error; the group and the run go on.
A RewardError (the user's reward function failed) still reaches the caller, which dead-letters the
group, as before tools ran here.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor

from reel.producers.envs import Env, Prompt, Reply
from reel.producers.envs.rewards import RewardError
from reel.runtime.config.sections import RolloutSection


class ToolCut(Exception):
    """An env call that was cut (timeout) or failed; str() is the reason kept in the trajectory."""


class ToolCalls:
    """Runs env.respond for the episodes of one worker (or one warm-start, one eval)."""

    concurrency: int  # calls at once (rollout.tool_concurrency)
    timeout_s: float  # a call's limit, slot wait included (rollout.tool_timeout_s)
    _slots: asyncio.Semaphore | None  # made on first use, on the loop that uses it
    _pool: ThreadPoolExecutor | None  # made on the first plain `respond`

    def __init__(self, concurrency: int, timeout_s: float):
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._slots = None
        self._pool = None

    @classmethod
    def from_section(cls, rollout: RolloutSection) -> ToolCalls:
        return cls(rollout.tool_concurrency, rollout.tool_timeout_s)

    async def respond(self, env: Env, prompt: Prompt, turns: list[list[int]]) -> Reply:
        """env.respond(prompt, turns); ToolCut with the reason when it is cut or fails."""
        try:
            return await asyncio.wait_for(self._call(env, prompt, turns), self.timeout_s)
        except TimeoutError:
            raise ToolCut(f"env {env.name} did not answer model turn {len(turns) // 2 + 1} within "
                          f"rollout.tool_timeout_s = {self.timeout_s:g} s") from None
        except (asyncio.CancelledError, RewardError, ToolCut):
            raise
        except Exception as exc:
            raise ToolCut(f"env {env.name} failed on model turn {len(turns) // 2 + 1}: "
                          f"{type(exc).__name__}: {exc}") from exc

    async def _call(self, env: Env, prompt: Prompt, turns: list[list[int]]) -> Reply:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        await self._slots.acquire()
        if inspect.iscoroutinefunction(env.respond):
            try:
                return await env.respond(prompt, turns)
            finally:
                self._slots.release()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reel-tool")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, env.respond, prompt, turns)
        future.add_done_callback(self._thread_done)
        return await asyncio.shield(future)

    def _thread_done(self, future: asyncio.Future[Reply]) -> None:
        # The slot is the thread: it comes back when the call returns, even after a timeout cut it.
        self._slots.release()
        if not future.cancelled():
            future.exception()  # retrieved, so a call cut before it failed logs no "never retrieved" error

    def close(self) -> None:
        """Let the pool's threads end (a hung one is left to finish on its own: it cannot be killed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
