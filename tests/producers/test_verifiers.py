"""verifiers 0.4 environments on Reel's engine: the train client's calls reach the engine through the
generate route, episodes come back as the engine's own completions (tokens, logprobs, version spans,
routing) with env turns masked, per-function rewards; a failed episode drops its group with the reason."""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import msgspec
import numpy as np
import pytest
import torch

pytest.importorskip("verifiers.v1", reason="the `tasks` extra (pip install '.[tasks]')")

from reel.producers.builtin_engine import BuiltinEngine  # noqa: E402
from reel.producers.engine import SamplingParams  # noqa: E402
from reel.producers.envs import make_env  # noqa: E402
from reel.producers.envs.rewards import RewardError  # noqa: E402
from reel.producers.envs.verifiers_renderer import tool_calls  # noqa: E402
from reel.producers.episode import run_group  # noqa: E402
from reel.producers.generate_route import GenerateRoute  # noqa: E402
from reel.runtime.config.keys import ConfigError  # noqa: E402
from reel.runtime.config.sections import EnvSection  # noqa: E402
from reel.runtime.model.config import MoEConfig  # noqa: E402
from reel.runtime.model.model import MoEModel  # noqa: E402
from reel.runtime.tokenizer import CharTokenizer  # noqa: E402
from paths import REPO  # noqa: E402

torch.set_num_threads(2)
TOK = CharTokenizer()
CFG = MoEConfig(vocab_size=49, initializer_range=0.1)


def _model() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(CFG).eval()


def _env(kind: str, **options):
    return make_env(EnvSection(name="verifiers:vf-fixtures", options={"args": {"kind": kind}, **options}), 6)


def _group(env, n=3, seed=11, swap_at=None):
    """A group of the env's first prompt on the built-in engine, with the engine's own direct answers for
    the same prompts and seeds (a second engine with the same weights)."""

    async def go():
        async with BuiltinEngine(_model(), max_batch=8, version=0) as engine:
            prompt = env.sample(random.Random(2))
            params = SamplingParams(n=n, max_tokens=6, stop_token_ids=TOK.stop_ids, seed=seed)
            episodes = await run_group(engine, env, prompt, params)
            direct = await engine.generate(prompt.ids, params)
            return prompt, episodes, direct

    return asyncio.run(go())


def test_single_turn_episodes_are_the_engines_completions_with_per_function_rewards():
    env = _env("single")
    prompt, episodes, direct = _group(env)
    assert prompt.ids == TOK.prompt_ids(f"reverse:{env.tasks[prompt.meta['index']].data.word}=")
    assert prompt.answer == env.tasks[prompt.meta["index"]].data.answer
    for i, (episode, c) in enumerate(zip(episodes, direct)):
        # Sample i's seed is params.seed + i, as for native envs: the same tokens as a direct request.
        assert episode.seed == 11 + i and episode.tokens == c.tokens and episode.logprobs == c.logprobs
        assert episode.spans == [(0, 0)] and episode.env_spans == [] and episode.turn_lengths == [len(c.tokens)]
        assert episode.routing.shape == (len(prompt.ids) + len(c.tokens) - 1, CFG.num_hidden_layers,
                                         CFG.num_experts_per_tok)
        np.testing.assert_array_equal(episode.routing, c.routing)
        text = TOK.decode(c.tokens[:-1] if c.tokens[-1] in TOK.stop_ids else c.tokens, skip_special=True).strip()
        correct, short = float(text == prompt.answer), float(len(text) <= 4)
        assert episode.scores == {"correct": correct, "short": short}
        assert episode.reward == pytest.approx(1.0 * correct + 0.5 * short)


def test_the_reference_answer_is_the_tasks_answer_field_and_none_is_refused_for_the_warm_start():
    env = _env("single")
    prompt = env.sample(random.Random(2))
    assert env.reference(prompt) == TOK.encode(prompt.answer) + [TOK.eos_id]
    with pytest.raises(ConfigError, match=r"init.warmup_steps trains on reference answers, and verifiers env "
                                          r"'vf-fixtures' has none"):
        env.reference(msgspec.structs.replace(prompt, answer=""))


def test_multi_turn_env_turns_are_masked_prompt_tokens_between_the_engines_turns():
    env = _env("multi")
    prompt, episodes, _ = _group(env, n=2)
    again = TOK.turn_ids("user", "again")
    for episode in episodes:
        first, second = episode.turn_lengths
        assert len(episode.turns) == 3 and episode.turns[1] == again
        assert episode.env_spans == [(first, first + len(again))]
        assert episode.tokens == episode.turns[0] + again + episode.turns[2] and len(episode.turns[2]) == second
        assert episode.logprobs[first:first + len(again)] == [0.0] * len(again)  # env tokens: never trained on
        assert all(lp < 0 for lp in episode.logprobs[:first] + episode.logprobs[first + len(again):])
        assert episode.routing.shape[0] == len(prompt.ids) + len(episode.tokens) - 1


@pytest.mark.parametrize("kind, options, message", [
    ("exits", {}, r"an episode failed: HarnessError: harness 'vf-fixtures' exited 3: the agent crashed"),
    ("slow", {"timeout_s": 1}, r"a group's episodes ran past env.options.timeout_s = 1 s"),
    ("nan", {}, r"reward function 'correct' returned nan"),
])
def test_a_failed_episode_drops_its_group_with_the_reason(kind, options, message):
    with pytest.raises(RewardError, match=message):
        _group(_env(kind, **options), n=2)


def test_the_route_wants_the_run_key_and_answers_the_train_clients_request():
    async def go():
        async with BuiltinEngine(_model(), max_batch=4, version=0) as engine:
            route = GenerateRoute(engine, "secret-key", "m", max_tokens=4, max_model_len=64)
            await route.start()
            try:
                async with httpx.AsyncClient(base_url=route.url) as http:
                    body = {"model": "m", "token_ids": TOK.prompt_ids("reverse:abc="),
                            "sampling_params": {"max_tokens": 99, "seed": 5, "logprobs": 1}}
                    refused = await http.post("/inference/v1/generate", json=body)
                    answered = await http.post("/inference/v1/generate", json=body,
                                               headers={"Authorization": "Bearer secret-key"})
                    again = await http.post("/inference/v1/generate", json=body,
                                            headers={"Authorization": "Bearer secret-key"})
                return refused, answered.json(), again.json(), route
            finally:
                await route.stop()

    refused, answered, again, route = asyncio.run(go())
    assert refused.status_code == 401 and "the run's key is required" in refused.text
    choice = answered["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 4  # max_tokens capped at the route's
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(math.isfinite(e["logprob"]) for e in choice["logprobs"]["content"])
    # A second call with the same seed is the episode's next turn: it samples with the next seed.
    assert sum(map(len, route.sampled.values())) == 2 and route.take(answered["prompt_token_ids"], choice["token_ids"]) is not None
    assert again["choices"][0]["token_ids"] != choice["token_ids"] or len(choice["token_ids"]) == 1


def test_tool_calls_are_read_in_hermes_form_or_compact_form_for_offered_tools():
    peek = [{"type": "function", "function": {"name": "peek", "parameters": {
        "type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}}}]
    (hermes,) = tool_calls('<tool_call>{"name": "peek", "arguments": {"i": 2}}</tool_call>', peek)
    assert (hermes.name, hermes.arguments) == ("peek", {"i": 2})
    (compact,) = tool_calls("peek:3", peek)
    assert (compact.name, compact.arguments) == ("peek", {"i": 3})
    assert tool_calls("peek:3", []) == [] and tool_calls("cba", peek) == []


class PeekFirst(BuiltinEngine):
    """The built-in engine, except that each episode's first turn is the scripted text "peek:1" + eos (a tool
    call in the compact form; a tiny random model would not call it), its logprobs and routing cut from a
    real sample of the same prompt."""

    async def generate(self, prompt_ids, params):
        completions = await super().generate(prompt_ids, params)
        if prompt_ids[-1] != TOK.encode("=")[0]:  # a later turn (after the tool result): sampled as is
            return completions
        script = TOK.encode("peek:1") + [TOK.eos_id]
        for c in completions:
            real = len(c.tokens)
            c.tokens = script
            c.logprobs = (c.logprobs * len(script))[:len(script)]
            c.routing = np.concatenate([c.routing] + [c.routing[-1:]] * len(script))[:len(prompt_ids) + len(script) - 1]
            c.finish_reason = "stop"
            assert real >= 1
        return completions


def test_a_tool_call_runs_the_examples_tool_and_its_result_is_an_env_turn(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples" / "vf_reverse"))  # the example's package, installed or not
    env = make_env(EnvSection(name="verifiers:vf-reverse", options={"args": {"num_examples": 20, "tools": True}}), 6)

    async def go():
        async with PeekFirst(_model(), max_batch=8, version=0) as engine:
            prompt = env.sample(random.Random(2))
            params = SamplingParams(n=2, max_tokens=6, stop_token_ids=TOK.stop_ids, seed=11)
            return prompt, await run_group(engine, env, prompt, params)

    prompt, episodes = asyncio.run(go())
    word = env.tasks[prompt.meta["index"]].data.word
    result = TOK.turn_ids("tool", word[1])  # peek(1): the word's second letter
    for episode in episodes:
        call = TOK.encode("peek:1") + [TOK.eos_id]
        assert episode.turns[:2] == [call, result] and episode.tool_calls == 1
        assert episode.env_spans == [(len(call), len(call) + len(result))] and len(episode.turn_lengths) == 2
        assert episode.routing.shape[0] == len(prompt.ids) + len(episode.tokens) - 1


@pytest.mark.slow
def test_failed_episodes_dead_letter_their_groups_and_a_resumed_run_goes_on(tmp_path, monkeypatch):
    from reel.bus.events import RunFinished, StepCommitted, Trajectory
    from reel.bus.run_log import RunLog
    from reel.runtime.launch.cli import main
    from paths import SUPPORT

    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the roles import vf_fixtures
    config = tmp_path / "vf.toml"
    config.write_text("""
[run]
name = "vf"
steps = 3
[init]
warmup_steps = 20
[env]
name = "verifiers:vf-fixtures"
[env.options]
args = {kind = "flaky", rows = 6}
[rollout]
concurrency = 4
group_size = 4
max_tokens = 6
[trainer]
batch_groups = 4
max_off_policy_steps = 2
""")
    run_dir = tmp_path / "run"
    monkeypatch.setenv("REEL_CRASH_AT", "2:committed")  # stopped mid-run and resumed
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 1
    monkeypatch.delenv("REEL_CRASH_AT")
    assert main(["run", str(config), "--out", str(run_dir), "--no-live", "--resume"]) == 0
    with RunLog(run_dir, readonly=True) as log:
        commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]
        finished = [e for _, e in log.events("control") if isinstance(e, RunFinished)]
        logged = [e for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    assert [c.step for c in commits] == [1, 2, 3] and finished[-1].dead_letters >= 1
    assert logged and all(t.meta["index"] not in (0, 3) for t in logged)  # "abc", "moon": never trained on
    assert all(set(s.scores) == {"correct", "short"} for t in logged for s in t.samples)
    rollout_log = (run_dir / "roles" / "rollout-0.log").read_text()
    assert "an episode failed: HarnessError: harness 'vf-fixtures' exited 3: the agent crashed" in rollout_log


class SwapBeforeSecondRequest(BuiltinEngine):
    """The built-in engine; policy version 1 goes live right before its second request (the episode's second turn)."""

    def __init__(self, model: MoEModel, new_weights):
        super().__init__(model, max_batch=8, version=0)
        self.new_weights, self.requests = new_weights, 0

    async def generate(self, prompt_ids, params):
        self.requests += 1
        if self.requests == 2:
            await self.update_weights(self.new_weights, 1)
        return await super().generate(prompt_ids, params)


def test_a_weight_update_between_turns_starts_a_new_policy_span_where_the_next_turn_starts():
    from reel.runtime.model import state_dict_adapter

    env = _env("multi")
    torch.manual_seed(1)
    new = state_dict_adapter.to_hf(MoEModel(CFG).state_dict(), CFG)

    async def go():
        async with SwapBeforeSecondRequest(_model(), new) as engine:
            prompt = env.sample(random.Random(2))
            return await run_group(engine, env, prompt, SamplingParams(n=1, max_tokens=6, stop_token_ids=TOK.stop_ids,
                                                                       seed=11))

    (episode,) = asyncio.run(go())
    first, again = episode.turn_lengths[0], len(episode.turns[1])
    assert episode.spans == [(0, 0), (first + again, 1)]  # the second turn was sampled under version 1
