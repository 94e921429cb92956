"""Environments and tokenizers: round trips, rewards, seeded sampling, long-tail share."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reel.producers.envs import CharTokenizer, Continue, Finish, HFTokenizer, TokenizerError, make_env
from reel.producers.envs.reverse_text import lcs_length
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError

TOK = CharTokenizer()


def _ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_char_tokenizer_round_trip_and_small_vocab():
    text = "<bos>reverse:hello world=dlrow olleh<eos><pad>0123456789.,;?!-+"
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert TOK.vocab_size == 49 < 64 and max(ids) < TOK.vocab_size
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.decode(ids, skip_special=True) == "reverse:hello world=dlrow olleh0123456789.,;?!-+"
    assert TOK.decode([TOK.vocab_size + 3]) == "\ufffd"
    with pytest.raises(TokenizerError, match="'Q' at position 2"):
        TOK.encode("abQ")


def test_hf_tokenizer_chat_template_and_stop_ids(tmp_path):
    from hf_checkpoint import train_tokenizer

    train_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.eos_id, tok.stop_ids, tok.pad_id, tok.bos_id) == (2, (2, 0), 0, None)
    env = make_env(EnvSection(name="reverse_text"), tokenizer=tok)
    prompt = env.sample(random.Random(0))
    assert tok.decode(prompt.ids) == f"<|im_start|>user\nreverse:{prompt.meta['question']}=<|im_end|>\n<|im_start|>assistant\n"
    assert env.reward(prompt, env.reference(prompt)) == 1.0
    assert env.reward(prompt, tok.encode(prompt.answer) + [0]) == 1.0  # any stop id ends the answer
    assert tok.decode(tok.turn_ids("tool", "=42;")) == "\n<|im_start|>tool\n=42;<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        HFTokenizer.from_dir(tmp_path / "missing")


def test_prompt_format_and_reference():
    env = make_env(EnvSection(name="sort_digits", min_len=5, max_len=5))
    prompt = env.sample(random.Random(3))
    question = prompt.meta["question"]
    assert prompt.text == f"<bos>sort:{question}=" and prompt.ids == _ids(prompt.text)
    assert prompt.answer == "".join(sorted(question)) and len(question) == 5
    assert env.reference(prompt) == _ids(prompt.answer) + [TOK.eos_id]


def test_reverse_text_rewards():
    env = make_env(EnvSection(name="reverse_text"))
    prompt = env.sample(random.Random(0))
    prompt.answer = "edcba"  # the reward reads only the answer
    assert env.reward(prompt, _ids("edcba<eos>")) == 1.0
    assert env.reward(prompt, _ids("edcba<eos>zzzz")) == 1.0  # after eos is ignored
    assert env.reward(prompt, _ids("ecba<eos>")) == pytest.approx(4 / 5)  # one letter missing
    assert env.reward(prompt, _ids("edcbaxy<eos>")) == pytest.approx(5 / 7)  # extra letters
    assert env.reward(prompt, _ids("abcde<eos>")) == pytest.approx(1 / 5)  # not reversed
    assert env.reward(prompt, _ids("<eos>")) == 0.0 and env.reward(prompt, []) == 0.0
    assert env.reward(prompt, _ids("edcba")) == 0.5  # never emitted eos: halved
    assert env.reward(prompt, _ids("ed<bos>cba<eos>")) == 1.0  # special tokens carry no text


def test_sort_digits_exact_match():
    env = make_env(EnvSection(name="sort_digits"))
    prompt = env.sample(random.Random(0))
    prompt.answer = "0117"
    assert env.reward(prompt, _ids("0117<eos>")) == 1.0
    assert env.reward(prompt, _ids("0117")) == 0.0  # no eos
    assert env.reward(prompt, _ids("017<eos>")) == 0.0 and env.reward(prompt, _ids("<eos>")) == 0.0


def test_lcs_length():
    assert lcs_length("abcbdab", "bdcaba") == 4 and lcs_length("", "abc") == 0 and lcs_length("abc", "abc") == 3


@pytest.mark.parametrize("name", ["reverse_text", "sort_digits"])
def test_seeded_sampling_is_reproducible_and_respects_lengths(name):
    env = make_env(EnvSection(name=name, min_len=2, max_len=4))

    def draw(seed: int) -> list:
        rng = random.Random(seed)
        return [env.sample(rng) for _ in range(50)]

    a = draw(7)
    assert a == draw(7) and a != draw(8)
    assert {len(p.meta["question"]) for p in a} == {2, 3, 4}


def test_long_tail_share_and_length():
    env = make_env(EnvSection(name="reverse_text", min_len=3, max_len=6, long_tail=0.25), max_tokens=16)
    rng = random.Random(0)
    prompts = [env.sample(rng) for _ in range(2000)]
    long = [p for p in prompts if p.meta["long_tail"]]
    assert 0.22 < len(long) / len(prompts) < 0.28
    assert {len(env.reference(p)) for p in long} == {16}  # answer + eos fills rollout.max_tokens
    assert max(len(p.answer) for p in prompts if not p.meta["long_tail"]) == 6


def test_make_env_errors():
    with pytest.raises(ConfigError, match="env.name = 'nope'"):
        make_env(EnvSection(name="nope"))
    with pytest.raises(ConfigError, match="raise rollout.max_tokens"):
        make_env(EnvSection(max_len=10, long_tail=0.1), max_tokens=8)
    with pytest.raises(ConfigError, match="env.options = {'x': 1} is not used"):
        make_env(EnvSection(options={"x": 1}))


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["reverse_text", "sort_digits"]), seed=st.integers(0, 2**32),
       completion=st.lists(st.integers(0, TOK.vocab_size + 5), max_size=40))
def test_reward_in_unit_interval_for_any_completion(name, seed, completion):
    env = make_env(EnvSection(name=name, min_len=1, max_len=8))
    prompt = env.sample(random.Random(seed))
    assert 0.0 <= env.reward(prompt, completion) <= 1.0


def test_arith_rewards_exact_integers():
    env = make_env(EnvSection(name="arith", options={"max_value": 9}))
    prompts = [env.sample(random.Random(s)) for s in range(200)]
    assert {p.meta["kind"] for p in prompts} == {"more", "away", "boxes"} and all(int(p.answer) >= 0 for p in prompts)
    p = prompts[0]
    assert env.reward(p, env.reference(p)) == 1.0
    assert env.reward(p, _ids(f"so {p.answer}<eos>")) == 1.0  # the last integer is the answer
    assert env.reward(p, _ids(f"{int(p.answer) + 1}<eos>")) == 0.0
    assert env.reward(p, _ids(p.answer)) == 0.0  # no eos: unfinished


def test_calc_tool_episode_protocol_and_long_tail():
    env = make_env(EnvSection(name="calc_tool", options={"max_terms": 6, "terms_per_call": 3}))
    prompts = [env.sample(random.Random(s)) for s in range(2000)]
    terms = [p.meta["terms"] for p in prompts]
    assert 0.45 < terms.count(2) / len(terms) < 0.55 and max(terms) == 6
    demo_turns = {len(env.demonstration(p)) // 2 + 1 for p in prompts}
    assert demo_turns == {2, 3, 4}  # 1, 2 or 3 calls, then the answer
    assert env.max_turns == 5
    p = next(p for p in prompts if p.meta["terms"] == 5)
    demo = env.demonstration(p)
    for i in range(0, len(demo) - 1, 2):  # every call of the demonstration gets the env's next turn
        reply = env.respond(p, demo[:i + 1])
        assert reply == Continue(demo[i + 1], tool_call=True)
    assert env.respond(p, demo) == Finish(1.0)
    call = _ids("call:1+2+3+4<eos>")  # more numbers than one call takes
    assert env.respond(p, [call]) == Continue(_ids("=error;"), tool_call=True)
    assert env.respond(p, [_ids("call:2+-<eos>")]) == Continue(_ids("=error;"), tool_call=True)
    assert env.respond(p, [_ids(p.answer + "<eos>")]) == Finish(1.0)  # answering directly is allowed
    assert env.respond(p, [_ids("call:1+2")]) == Finish(0.0)  # no eos: not a call, not an answer
    at_limit = [call, _ids("=error;")] * (env.max_turns - 1) + [call]
    assert env.respond(p, at_limit) == Finish(0.0)  # a call in the last turn ends the episode


def test_slow_calc_answers_as_calc_tool_after_a_seeded_heavy_tailed_wait():
    import asyncio
    import inspect
    import statistics
    import time

    from reel.producers.envs.slow_calc import ToolLatency

    env = make_env(EnvSection(name="slow_calc", options={"tool_median_s": 0.2, "tool_sigma": 0.0}))
    calc = make_env(EnvSection(name="calc_tool"))
    assert inspect.iscoroutinefunction(env.respond)  # awaited on the loop: a waiting call holds only its episode
    p = env.sample(random.Random(3))
    assert p.ids == calc.sample(random.Random(3)).ids and p.meta["env"] == "slow_calc"
    demo = env.demonstration(p)

    async def answer(turns):
        started = time.monotonic()
        return await env.respond(p, turns), time.monotonic() - started

    reply, waited = asyncio.run(answer(demo[:1]))  # a tool call: answered as calc_tool does, after 0.2 s
    assert reply == calc.respond(p, demo[:1]) and reply.tool_call and 0.2 <= waited < 1.0
    reply, waited = asyncio.run(answer(demo))  # the answer: scored at once, no tool
    assert reply == Finish(1.0) and waited < 0.1
    assert env.reward(p, env.reference(p)) == 1.0  # one turn: no tool, no wait

    latency = ToolLatency(median_s=0.05, sigma=1.25, max_s=2.0, seed=0)
    delays = [latency.delay(f"call {i}") for i in range(4000)]
    assert delays == [ToolLatency(0.05, 1.25, 2.0, 0).delay(f"call {i}") for i in range(4000)]  # seeded
    assert delays != [ToolLatency(0.05, 1.25, 2.0, 1).delay(f"call {i}") for i in range(4000)]
    assert 0.045 < statistics.median(delays) < 0.055 and 0.09 < statistics.mean(delays) < 0.13
    assert max(delays) == 2.0 and 0.002 < sum(d > 1.0 for d in delays) / len(delays) < 0.02  # a long tail, capped
    with pytest.raises(ConfigError, match="tool_median_s = 3.0, tool_max_s = 2.0"):
        make_env(EnvSection(name="slow_calc", options={"tool_median_s": 3.0}))
