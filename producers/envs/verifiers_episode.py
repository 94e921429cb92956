"""A verifiers 0.4 group run on Reel's engine, and its episodes as Reel episodes.

`Runs` holds, per event loop, what a group needs: the generate route in front of the worker's
engine (producers/generate_route.py) and the verifiers env's `serving()` (its interception server,
shared tools). `Runs.group` plans `n` slots of the task, runs them with a `TrainClientConfig` that
points at the route, and turns each finished `vf.Episode` into a Reel `Episode`:

    branch     token_ids = prompt | model turn | env turn | model turn ...   (sampled_mask marks model turns)
    Reel       each sampled run is the completion the engine sampled for exactly the tokens before it
               (its logprobs, version spans and routing come with it: Episode.add_model_turn); each
               unsampled run is an env turn (prompt tokens, never trained on: Episode.add_env_turn)

An episode that cannot be trained on raises RewardError with the reason (its `errors`, a trace that
is not ok, more than one trainable branch, tokens the engine did not sample, a reward that is not a
finite number): the rollout worker dead-letters the group, the eval role leaves the prompt out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from reel.producers.engine import Engine, SamplingParams
from reel.producers.envs.base import Prompt
from reel.producers.envs.rewards import RewardError
from reel.producers.envs.verifiers_renderer import MULTIPLEX, ReelRenderer, install
from reel.producers.episode import Episode
from reel.producers.generate_route import GenerateRoute
from reel.producers.vllm_auth import KEY_ENV

KEY_VAR = "REEL_GENERATE_KEY"  # the variable verifiers' client reads the route's key from (api_key_var)
MAX_MODEL_LEN = 1 << 20


@dataclass
class Runs:
    env: Any  # the Verifiers adapter
    max_tokens: int
    renderer: ReelRenderer = field(init=False)
    model: str = field(init=False)  # the model name the client sends; also the renderer's pool key

    def __post_init__(self) -> None:
        self.renderer = ReelRenderer(self.env.tokenizer)
        self.model = f"reel-{self.env.env_id}-{id(self):x}"
        install(self.model, self.env.tokenizer)

    @contextlib.asynccontextmanager
    async def serving(self, engine: Engine) -> AsyncIterator[GenerateRoute]:
        """The route in front of `engine` and the env's serving resources, for one group. Per group, not
        per worker: both stop when the group ends, on whatever loop it ran (the eval role's, the warm-start's)."""
        # The run's key when Reel's vLLM servers have one, else this process's own.
        os.environ[KEY_VAR] = os.environ.get(KEY_ENV) or os.environ.get(KEY_VAR) or secrets.token_urlsafe(32)
        route = GenerateRoute(engine, os.environ[KEY_VAR], self.model, self.max_tokens, MAX_MODEL_LEN)
        await route.start()
        known = known_context_length(route.url, self.model)
        try:
            async with self.env.vf_env.serving():
                yield route
        finally:
            for key in known:
                _context_lengths().pop(key, None)
            await route.stop()

    def context(self, route: GenerateRoute, params: SamplingParams, seed: int) -> Any:
        import verifiers.v1 as vf

        client = vf.TrainClientConfig(base_url=f"{route.url}/v1", api_key_var=KEY_VAR,
                                      renderer_model_name=self.model, multiplex=MULTIPLEX)
        sampling = vf.SamplingConfig(temperature=params.temperature, top_p=params.top_p,
                                     max_tokens=params.max_tokens, seed=seed)
        return vf.ModelContext(model=self.model, client=client, sampling=sampling)

    async def group(self, engine: Engine, task: Any, prompt: Prompt, params: SamplingParams) -> list[Episode]:
        vf_env = self.env.vf_env
        seeds = [params.seed + i for i in range(params.n)]
        slots = vf_env.slots(task, params.n)
        what = f"verifiers env {self.env.env_id!r}"
        async with self.serving(engine) as route:
            for seed in seeds:
                route.expect(seed, params.n)  # turn t of sample i: seed + t * n + i, as for native envs
            try:
                done = await asyncio.wait_for(asyncio.gather(*(
                    vf_env.run_slot(slot, self.context(route, params, seed)) for slot, seed in zip(slots, seeds))),
                    self.env.timeout_s)
            except TimeoutError:
                raise RewardError(f"{what}: a group's episodes ran past env.options.timeout_s = "
                                  f"{self.env.timeout_s:g} s") from None
            return [episode_of(what, route, prompt, seed, vf_episode) for seed, vf_episode in zip(seeds, done)]


def _context_lengths() -> dict:
    from renderers import client

    return client._max_prompt_len_cache


def known_context_length(url: str, model: str) -> list[tuple[str, str]]:
    """Tell the renderers client the route's context length up front. It would otherwise ask GET /v1/models
    once per (url, model) under a module-wide asyncio.Lock, which binds to the first event loop that waits
    on it: the next loop in this process (the eval role's, a test's) would fail every model call."""
    keys = [(f"{url}/v1/", model), (f"{url}/v1", model)]
    for key in keys:
        _context_lengths()[key] = MAX_MODEL_LEN
    return keys


def episode_of(what: str, route: GenerateRoute, prompt: Prompt, seed: int, vf_episode: Any) -> Episode:
    """The Reel episode of a finished verifiers episode (module docstring); RewardError when it cannot be trained."""
    if vf_episode.errors:
        error = vf_episode.errors[-1]
        raise RewardError(f"{what}: an episode failed: {error.type}: {error.message}".splitlines()[0])
    failed = next((t for t in vf_episode.traces if not t.ok), None)
    if failed is not None:
        reason = f"{failed.errors[-1].type}: {failed.errors[-1].message}" if failed.errors else "its trace is not ok"
        raise RewardError(f"{what}: an episode failed: {reason}".splitlines()[0])
    traces = [t for t in vf_episode.traces if any(b.trainable for b in t.branches)]
    if len(traces) != 1:
        raise RewardError(f"{what}: an episode has {len(traces)} traces with trainable branches; "
                          "Reel trains one agent's single branch per sample")
    trace = traces[0]
    branches = [b for b in trace.branches if b.trainable]
    if len(branches) != 1:
        raise RewardError(f"{what}: an episode's trace has {len(branches)} trainable branches; Reel trains one")
    episode = tokens_of(what, route, prompt, seed, branches[0].token_ids, branches[0].sampled_mask)
    episode.tool_calls = sum(len(m.tool_calls or []) for m in branches[0].messages if m.role == "assistant")
    scores = {}
    for name, reward in trace.rewards.items():
        if reward is not None and not math.isfinite(reward.score):
            raise RewardError(f"{what}: reward function {name!r} returned {reward.score}")
        scores[name] = 0.0 if reward is None else float(reward.score)
    episode.reward, episode.scores = float(trace.reward), scores
    return episode


def tokens_of(what: str, route: GenerateRoute, prompt: Prompt, seed: int, ids: list[int],
              sampled: list[bool]) -> Episode:
    """The branch's tokens after the prompt as model turns (the engine's completions) and env turns."""
    if ids[:len(prompt.ids)] != prompt.ids or any(sampled[:len(prompt.ids)]):
        raise RewardError(f"{what}: an episode's branch does not start with the prompt Reel rendered for its task")
    episode = Episode(seed=seed)
    start = len(prompt.ids)
    while start < len(ids):
        end = start
        while end < len(ids) and sampled[end] == sampled[start]:
            end += 1
        if not sampled[start]:
            episode.add_env_turn(list(ids[start:end]))
        else:
            completion = route.take(ids[:start], ids[start:end])
            if completion is None:
                raise RewardError(f"{what}: an episode's model turn at token {start - len(prompt.ids)} is not "
                                  "what Reel's engine sampled for it")
            episode.add_model_turn(completion)
        start = end
    if not episode.turn_lengths:
        raise RewardError(f"{what}: an episode has no model turn")
    return episode
