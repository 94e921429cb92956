"""Offline re-scoring: a logged Trajectory's samples scored again by a (possibly different) env reward.

`reel retrain --rescore` reaches this by name (consumers/ never import producers/). The prompt is
rebuilt from the Trajectory (its ids and meta, which keep what the reward needs: task and entry,
answer, data_source, info), and each sample's completion goes to `env.reward`. Single-turn samples
only: a multi-turn episode's reward depends on the env turns it took, which only a new rollout gives.
"""

from __future__ import annotations

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import Trajectory
from reel.producers.envs import Prompt, env_for
from reel.producers.envs.rewards import RewardError
from reel.runtime.config.sections import Config


class RescoreError(ReelError):
    """A logged group that cannot be re-scored."""


def rescorer(config: Config):
    """A function Trajectory -> Trajectory with every sample's reward from `config`'s env."""
    env = env_for(config)

    def rescore(trajectory: Trajectory) -> Trajectory:
        ids = trajectory.prompt.numpy().tolist()
        prompt = Prompt(text=env.tokenizer.decode(ids), ids=ids, answer=str(trajectory.meta.get("answer", "")),
                        meta=dict(trajectory.meta))
        samples = []
        for i, sample in enumerate(trajectory.samples):
            if sample.turns > 1:
                raise RescoreError(f"group {trajectory.group_id} sample {i} took {sample.turns} model turns; "
                                   "only single-turn samples can be re-scored offline")
            try:
                reward = env.reward(prompt, sample.tokens.numpy().tolist())
            except RewardError as exc:
                raise RescoreError(f"group {trajectory.group_id} sample {i}: {exc}") from exc
            samples.append(msgspec.structs.replace(sample, reward=reward))
        return msgspec.structs.replace(trajectory, samples=samples)

    return rescore
