"""Multi-turn episodes: env turns are prompt tokens (own spans, masked out of the loss), policy spans
and staleness follow a weight update that lands between two turns, user envs load by module path."""

from __future__ import annotations

import asyncio
import random

import msgspec
import numpy as np
import pytest
import torch

from reel.bus.events import RoutingTrace, Tensor, Trajectory
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.producers.envs import CharTokenizer, make_env
from reel.producers.envs.registry import check_config, check_name
from reel.producers.episode import run_group
from reel.producers.tool_calls import ToolCalls
from reel.runtime.train import loss as loss_mod
from reel.runtime.train.batch import Group, build_batch
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import from_dict
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.train.step import token_logprobs
from user_env_module import install

torch.set_num_threads(2)
CFG = MoEConfig(vocab_size=49, initializer_range=0.1)
TOOL_IDS = CharTokenizer().encode("=ok;")


def _model(seed: int) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(CFG).eval()


class SwapBeforeSecondRequest(BuiltinEngine):
    """The built-in engine; policy version 1 goes live right before its second request starts,
    i.e. between turn 1 and turn 2 of the episodes."""

    def __init__(self, model: MoEModel, new_weights: dict[str, torch.Tensor]):
        super().__init__(model, max_batch=8, version=0)
        self.new_weights = new_weights
        self.requests = 0

    async def generate(self, prompt_ids, params):
        self.requests += 1
        if self.requests == 2:
            await self.update_weights(self.new_weights, 1)
        return await super().generate(prompt_ids, params)


@pytest.fixture
def echo_env(tmp_path, monkeypatch):
    """The user env of user_env_module: three model turns, two tool turns between them."""
    return make_env(EnvSection(name=install(tmp_path, monkeypatch), options={"turns": 3}), max_tokens=4)


def _episodes(env, engine_model, new_model, n=2):
    new = state_dict_adapter.to_hf(new_model.state_dict(), CFG)

    async def go():
        async with SwapBeforeSecondRequest(engine_model, new) as engine:
            prompt = env.sample(random.Random(5))
            params = SamplingParams(n=n, max_tokens=4, stop_token_ids=env.tokenizer.stop_ids, seed=11)
            return prompt, await run_group(engine, env, prompt, params, ToolCalls(4, 10.0))

    return asyncio.run(go())


def test_user_env_loads_from_a_module_outside_the_package(tmp_path, monkeypatch):
    name = install(tmp_path, monkeypatch, "my_tasks")
    config = from_dict({"env": {"name": name, "options": {"turns": 2}}})
    env = make_env(config.env, max_tokens=4)
    assert type(env).__module__ == "my_tasks" and env.max_turns == 2
    with pytest.raises(ConfigError, match="module 'no_such_pkg.tasks' cannot be found"):
        check_name("no_such_pkg.tasks:make")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        make_env(EnvSection(name="my_tasks:nope"))
    with pytest.raises(ConfigError, match="rejected its settings"):
        make_env(EnvSection(name=name, options={"colour": "red"}))
    with pytest.raises(ConfigError, match="c.toml: env.name = 'chess' is unknown"):
        check_config(from_dict({"env": {"name": "chess"}}), "c.toml")  # as `reel run` checks a config it loads


def test_episode_turns_spans_staleness_across_a_weight_update(echo_env):
    old, new = _model(0), _model(1)
    prompt, episodes = _episodes(echo_env, _model(0), new)
    P = len(prompt.ids)
    for e in episodes:
        assert len(e.turn_lengths) == 3 and e.tool_calls == 2 and len(e.env_spans) == 2
        assert len(e.tokens) == sum(e.turn_lengths) + 2 * len(TOOL_IDS)
        for first, end in e.env_spans:
            assert e.tokens[first:end] == TOOL_IDS and e.logprobs[first:end] == [0.0] * len(TOOL_IDS)
        turn2 = e.env_spans[0][1]
        # Turn 1 under version 0, turns 2 and 3 under version 1 (the update landed between turns).
        assert e.spans == [(0, 0), (turn2, 1)]
        # Routing: positions fed by turn 1 keep version 0's experts; the rest were routed under version 1.
        ids = torch.tensor([prompt.ids + e.tokens[:-1]])
        with torch.no_grad():
            routed_old = old(ids, return_routing=True).routing[0].numpy()
            routed_new = new(ids, return_routing=True).routing[0].numpy()
        assert e.routing.shape == (P + len(e.tokens) - 1, len(CFG.moe_layers), CFG.num_experts_per_tok)
        cut = P + e.turn_lengths[0] - 1
        np.testing.assert_array_equal(np.sort(e.routing[:cut], -1), np.sort(routed_old[:cut], -1))
        np.testing.assert_array_equal(np.sort(e.routing[cut:], -1), np.sort(routed_new[cut:], -1))

    # In the trainer's batch: env tokens are never targets of the loss; versions and staleness per turn.
    batch = build_batch([_group(prompt, episodes)])
    for b, e in enumerate(episodes):
        targets = np.arange(P - 1, P - 1 + len(e.tokens))
        sampled = np.ones(len(e.tokens), bool)
        for first, end in e.env_spans:
            sampled[first:end] = False
        assert batch.loss_mask_BT[b, targets].numpy().tolist() == sampled.tolist()
        versions = batch.versions_BT[b, targets][torch.from_numpy(sampled)]
        assert versions.tolist() == [0] * e.turn_lengths[0] + [1] * (e.turn_lengths[1] + e.turn_lengths[2])
    staleness = loss_mod.staleness_histogram(batch.versions_BT[batch.loss_mask_BT], step=1)
    assert staleness == {1: sum(e.turn_lengths[0] for e in episodes),
                         0: sum(sum(e.turn_lengths[1:]) for e in episodes)}


def test_env_tokens_get_no_gradient(echo_env):
    prompt, episodes = _episodes(echo_env, _model(0), _model(1), n=4)
    batch = build_batch([_group(prompt, episodes, rewards=[0.0, 1.0, 0.5, 0.25])])
    model = _model(0).train()
    logp_BT = token_logprobs(model, batch, router_replay=True).logp_BT
    mask_BT = batch.loss_mask_BT
    loss, _ = loss_mod.policy_loss(
        logp_new_N=logp_BT[mask_BT], logp_old_N=logp_BT[mask_BT].detach(), logp_mu_N=batch.logp_mu_BT[mask_BT],
        advantages_N=batch.advantages_BT[mask_BT],
        seq_index_N=torch.arange(mask_BT.shape[0])[:, None].expand_as(mask_BT)[mask_BT],
        cfg=loss_mod.LossConfig())
    (grad_BT,) = torch.autograd.grad(loss, logp_BT)
    env_BT = torch.zeros_like(mask_BT)
    P = len(prompt.ids)
    for b, e in enumerate(episodes):
        for first, end in e.env_spans:
            env_BT[b, P - 1 + first:P - 1 + end] = True
    assert int(env_BT.sum()) == 4 * 2 * len(TOOL_IDS) and not (env_BT & mask_BT).any()
    assert torch.all(grad_BT[env_BT] == 0)
    assert torch.count_nonzero(grad_BT[mask_BT]) > 0


def _group(prompt, episodes, rewards=None) -> Group:
    samples = [e.sample() for e in episodes]
    if rewards is not None:
        samples = [msgspec.structs.replace(s, reward=r) for s, r in zip(samples, rewards)]
    trajectory = Trajectory(run="t", producer="rollout:0", seq=0, group_id="g", env="echo",
                            prompt=Tensor.from_numpy(np.asarray(prompt.ids, np.int32)), samples=samples,
                            worker="rollout:0")
    trace = RoutingTrace(run="t", producer="rollout:0", seq=1, group_id="g",
                         experts=[Tensor.from_numpy(e.routing) for e in episodes])
    return Group(trajectory, [t.numpy() for t in trace.experts])
