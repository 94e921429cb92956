"""One GRPO group of episodes: model turns from the engine, env turns from the env, until Finish.

    turn 1    one engine request for the whole group (n samples of the prompt, seeds seed + i)
    then      per sample: env.respond(prompt, turns) -> Continue(ids): the conversation so far
              plus ids is the next prompt (n = 1, its own seed) | Finish(reward): done

env.respond runs through ToolCalls (producers/tool_calls.py): off the event loop, bounded and timed,
so one episode's slow tool holds up only that episode. A call cut there (timeout, exception) ends
its episode with reward 0 and the reason in `env_error`; the group goes on.

An episode's `tokens` are every model turn with the env's turns between them; the env's tokens
are prompt tokens (logprob 0, listed in `env_spans`, never trained on). Policy spans are offset
to episode positions, so a weight update that lands between two turns shows as a new span where
the next turn starts. Routing: each turn's request routes the whole conversation; the episode
keeps, for every position, the routing of the turn that first fed it (its tokens were sampled
under those experts), so the trace is [P + len(tokens) - 1, L, K] as for one turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from reel.bus.events import Sample, Tensor
from reel.producers.engine import Completion, Engine, EngineError, SamplingParams
from reel.producers.envs import Continue, Env, Finish, Prompt, Reply
from reel.producers.envs.rewards import RewardError
from reel.producers.time_split import TimeSplit
from reel.producers.tool_calls import ToolCalls, ToolCut
from reel.runtime.config.sections import RolloutSection

log = logging.getLogger("reel.episode")


@dataclass
class Episode:
    """One sample of a group, all its turns."""

    seed: int  # the seed of its first turn
    tokens: list[int] = field(default_factory=list)  # model and env turns after the prompt
    logprobs: list[float] = field(default_factory=list)  # per token; 0.0 on env tokens
    spans: list[tuple[int, int]] = field(default_factory=list)  # [(first token, policy version)]
    env_spans: list[tuple[int, int]] = field(default_factory=list)  # [(first, end)) of env tokens
    turns: list[list[int]] = field(default_factory=list)  # model, env, model, ... (what the env sees)
    turn_lengths: list[int] = field(default_factory=list)  # tokens per model turn
    tool_calls: int = 0
    routing: np.ndarray | None = None  # [P + len(tokens) - 1, L, K]
    finish_reason: str = ""  # of the last model turn
    seconds: float = 0.0  # engine seconds over the model turns (Completion.seconds summed)
    reward: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)  # Finish.scores: the reward's parts by name
    env_error: str = ""  # why an env call was cut (timeout, exception): the episode ended there, reward 0
    env_s: list[float] = field(default_factory=list)  # wall seconds of each env.respond, cut ones included

    def add_model_turn(self, c: Completion) -> None:
        offset = len(self.tokens)
        for first, version in c.spans:
            if not self.spans or self.spans[-1][1] != version:
                self.spans.append((offset + first, version))
        self.tokens += c.tokens
        self.logprobs += c.logprobs
        self.turns.append(list(c.tokens))
        self.turn_lengths.append(len(c.tokens))
        self.finish_reason = c.finish_reason
        self.seconds += c.seconds
        # Positions already routed keep the routing of the turn that sampled them.
        self.routing = c.routing if self.routing is None else np.concatenate(
            [self.routing, c.routing[len(self.routing):]])

    def sample(self) -> Sample:
        """The episode as a Trajectory carries it."""
        return Sample(tokens=Tensor.from_numpy(np.asarray(self.tokens, np.int32)),
                      logprobs=Tensor.from_numpy(np.asarray(self.logprobs, np.float32)), reward=self.reward,
                      finish_reason=self.finish_reason, seed=self.seed, spans=self.spans, generate_s=self.seconds,
                      env_spans=self.env_spans, turns=len(self.turn_lengths), tool_calls=self.tool_calls,
                      turn_lengths=self.turn_lengths, scores=self.scores, env_error=self.env_error,
                      env_s=self.env_s)

    def add_env_turn(self, ids: list[int]) -> None:
        self.env_spans.append((len(self.tokens), len(self.tokens) + len(ids)))
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.turns.append(list(ids))


def non_finite(episodes: list[Episode]) -> str | None:
    """Why a group must not be trained, if an env's reward or an engine's logprob is NaN or inf.

    One such value makes the loss, and from it every weight of every later version, NaN."""
    for i, e in enumerate(episodes):
        if not math.isfinite(e.reward):
            return f"sample {i}: the env returned reward {e.reward}"
        bad = np.flatnonzero(~np.isfinite(np.asarray(e.logprobs, np.float64)))
        if bad.size:
            return f"sample {i}: the engine returned logprob {e.logprobs[bad[0]]} at completion token {bad[0]}"
    return None


async def run_group(engine: Engine, env: Env, prompt: Prompt, params: SamplingParams, calls: ToolCalls | None = None,
                    split: TimeSplit | None = None) -> list[Episode]:
    """params.n episodes of `prompt`, in sample order. `calls` runs the env's turns (default: a pool of
    this group's own, with rollout.tool_* defaults); `split` counts the worker's time (producers/time_split.py).
    An env that runs its own episodes (a verifiers 0.4 env: producers/envs/verifiers_env.py) has a
    `drive_group` coroutine taking (engine, prompt, params); it is used, and awaits its own tools."""
    drive = getattr(env, "drive_group", None)
    if drive is not None:
        return await drive(engine, prompt, params)
    own = calls is None
    turns = _Turns(engine, env, prompt, ToolCalls.from_section(RolloutSection()) if own else calls, split)
    try:
        firsts = await turns.generate(prompt.ids, params)
        return list(await asyncio.gather(*(turns.finish_episode(params, i, c) for i, c in enumerate(firsts))))
    finally:
        if own:
            turns.calls.close()


async def scored_group(engine: Engine, env: Env, prompt: Prompt, params: SamplingParams, calls: ToolCalls,
                       what: str) -> list[Episode] | None:
    """run_group, or None (logged, naming `what`) when the env's reward function failed on a sample: for
    figures that leave such a prompt out (the warm-start's reward, the eval role); rollout dead-letters it."""
    try:
        return await run_group(engine, env, prompt, params, calls)
    except RewardError as exc:
        log.warning("%s: a prompt's reward failed, left out: %s", what, exc)
        return None


@dataclass
class _Turns:
    """What a group's episodes take their turns with."""

    engine: Engine
    env: Env
    prompt: Prompt
    calls: ToolCalls
    split: TimeSplit | None

    async def generate(self, ids: list[int], params: SamplingParams) -> list[Completion]:
        with self.split.engine_turn() if self.split else contextlib.nullcontext():
            return await self.engine.generate(ids, params)

    async def respond(self, turns: list[list[int]]) -> Reply:
        with self.split.env_turn() if self.split else contextlib.nullcontext():
            return await self.calls.respond(self.env, self.prompt, turns)

    async def finish_episode(self, params: SamplingParams, index: int, first: Completion) -> Episode:
        env, prompt = self.env, self.prompt
        episode = Episode(seed=first.seed)
        completion = first
        while True:
            episode.add_model_turn(completion)
            started = time.monotonic()
            try:
                reply = await self.respond(episode.turns)
            except ToolCut as cut:  # the episode ends here; its group and the run go on
                log.warning("group of %r: sample %d cut: %s", prompt.text, index, cut)
                episode.env_error = str(cut)
                return episode
            finally:
                episode.env_s.append(time.monotonic() - started)
            if isinstance(reply, Finish):
                if isinstance(reply.reward, bool) or not isinstance(reply.reward, numbers.Real):
                    raise RewardError(f"env {env.name} returned the reward {reply.reward!r} "
                                      f"({type(reply.reward).__name__}), not a number")
                episode.reward = float(reply.reward)
                episode.scores = dict(reply.scores)
                return episode
            assert isinstance(reply, Continue)
            if len(episode.turn_lengths) >= env.max_turns:
                raise EngineError(f"env {env.name} answered model turn {len(episode.turn_lengths)} with Continue, "
                                  f"but its max_turns is {env.max_turns}; it must Finish there")
            episode.tool_calls += reply.tool_call
            episode.add_env_turn(reply.ids)
            turn = len(episode.turn_lengths)  # turns taken so far; seeds never repeat within the group
            next_params = msgspec.structs.replace(params, n=1, seed=params.seed + turn * params.n + index)
            (completion,) = await self.generate(prompt.ids + episode.tokens, next_params)
