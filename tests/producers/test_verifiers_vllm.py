"""A verifiers 0.4 group on Reel's vLLM engine: the train client's calls reach a real `vllm serve` (the CPU
build) through Reel's generate route and the vLLM adapter, and each turn's logprobs are Reel's forward's.
The server and tiny model are the session's (tests/producers/conftest.py, the command line `reel run` uses)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("verifiers.v1", reason="the `tasks` extra (pip install '.[tasks]')")

from reel.bus.blob_backends.file import BlobStore  # noqa: E402
from reel.producers.engine import SamplingParams  # noqa: E402
from reel.producers.envs import make_env  # noqa: E402
from reel.producers.episode import run_group  # noqa: E402
from reel.runtime.config.sections import EnvSection  # noqa: E402
from vllm_setup import http_engine, push, reel_logprobs, tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_a_verifiers_group_samples_on_vllm_through_the_route(models, server, server_blobs) -> None:
    env = make_env(EnvSection(name="verifiers:vf-fixtures", options={"args": {"kind": "multi"}}), 6)
    blobs = BlobStore(server_blobs)
    policy = tiny_model(3)  # weights no other test serves: the session's server must load them
    async with http_engine(models, server, blobs) as engine:
        await push(engine, policy, blobs, 0)
        prompt = env.sample(random.Random(2))
        episodes = await run_group(engine, env, prompt, SamplingParams(
            n=2, temperature=0.8, max_tokens=6, stop_token_ids=env.tokenizer.stop_ids, seed=7))
    again = env.tokenizer.turn_ids("user", "again")
    for episode in episodes:
        first, second = episode.turns[0], episode.turns[2]
        assert episode.turns[1] == again and episode.env_spans == [(len(first), len(first) + len(again))]
        assert episode.spans == [(0, 0)] and set(episode.scores) == {"correct", "short"}
        torch.testing.assert_close(torch.tensor(episode.logprobs[:len(first)]),
                                   reel_logprobs(policy, prompt.ids, first, temperature=0.8), atol=1e-4, rtol=0)
        context = prompt.ids + first + again
        torch.testing.assert_close(torch.tensor(episode.logprobs[len(first) + len(again):]),
                                   reel_logprobs(policy, context, second, temperature=0.8), atol=1e-4, rtol=0)
