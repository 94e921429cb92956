"""Environments and tokenizers: round trips, rewards, seeded sampling, long-tail share."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.envs import CharTokenizer, HFTokenizer, TokenizerError, make_env
from producers.envs.reverse_text import lcs_length
from runtime.config import ConfigError, EnvSection

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


def test_hf_tokenizer_wrapper(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|end|>": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz:=")}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(["<|end|>", "<s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"},
                                                                 "bos_token": None}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (0, 0, None, 30)
    env = make_env(EnvSection(name="reverse_text"), tokenizer=tok)
    prompt = env.sample(random.Random(0))
    assert prompt.ids[0] != tok.eos_id and tok.decode(prompt.ids).startswith("reverse:")
    assert env.reward(prompt, env.reference(prompt)) == 1.0
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
    with pytest.raises(ValueError, match="needs max_tokens"):
        make_env(EnvSection(long_tail=0.1))


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["reverse_text", "sort_digits"]), seed=st.integers(0, 2**32),
       completion=st.lists(st.integers(0, TOK.vocab_size + 5), max_size=40))
def test_reward_in_unit_interval_for_any_completion(name, seed, completion):
    env = make_env(EnvSection(name=name, min_len=1, max_len=8))
    prompt = env.sample(random.Random(seed))
    assert 0.0 <= env.reward(prompt, completion) <= 1.0
