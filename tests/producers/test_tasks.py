"""Task adapters: reward parity with each library's own scoring (reasoning-gym, verifiers, math-verify,
a verl compute_score), the answer-extraction rule, and bad input refused at config load."""

from __future__ import annotations

import json
import random

import pytest

from reel.producers.envs import make_env
from reel.producers.envs.answers import extract_answer, fold
from reel.producers.envs.rewards import RewardError, math_verify
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import loads
from reel.runtime.tokenizer import CharTokenizer
from user_config import load_as_reel_run

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the `tasks` extra (pip install '.[tasks]')")

TOK = CharTokenizer()
RG_TASKS = ("gcd", "spell_backward", "basic_arithmetic", "leg_counting", "count_bits")


def ids(text: str, stop: bool = True) -> list[int]:
    return TOK.encode(text) + ([TOK.eos_id] if stop else [])


def env_config(name: str, options: str) -> str:
    return f'[env]\nname = "{name}"\n[env.options]\n{options}\n'


# ---- reasoning-gym ------------------------------------------------------------------------------

@pytest.mark.parametrize("task", RG_TASKS)
def test_reasoning_gym_reward_is_the_datasets_own_score(task):
    env = make_env(EnvSection(name="reasoning_gym", options={"tasks": {task: 1.0}, "size": 40, "seed": 3}), 32)
    reference = reasoning_gym.create_dataset(task, size=40, seed=3)  # the library, built independently
    rng = random.Random(0)
    for _ in range(8):
        prompt = env.sample(rng)
        entry = reference[prompt.meta["entry"]["metadata"]["source_index"]]
        assert prompt.meta["entry"]["answer"] == entry["answer"] and prompt.meta["task"] == task
        right, wrong = entry["answer"], str(int(entry["answer"]) + 1) if entry["answer"].lstrip("-").isdigit() else "x"
        for answer in (right, wrong, "", f" {right} "):
            assert env.reward(prompt, ids(answer)) == reference.score_answer(answer.strip(), entry)
        assert env.reward(prompt, ids(right)) == 1.0 and env.reward(prompt, ids(wrong)) < 1.0


def test_reasoning_gym_mixes_tasks_by_weight_and_folds_prompts_for_the_character_tokenizer():
    env = make_env(EnvSection(name="reasoning_gym", options={
        "tasks": {"spell_backward": 3.0, "gcd": {"weight": 1.0, "min_value": 1, "max_value": 30}}, "size": 50}), 32)
    rng = random.Random(1)
    prompts = [env.sample(rng) for _ in range(400)]
    share = sum(p.meta["task"] == "spell_backward" for p in prompts) / len(prompts)
    assert 0.68 < share < 0.82  # 3:1
    assert all(TOK.decode(p.ids) == p.text and p.text == "<bos>" + fold(p.meta["entry"]["question"]) for p in prompts)
    gcd = [p for p in prompts if p.meta["task"] == "gcd"]
    assert all(max(p.meta["entry"]["metadata"]["numbers"]) <= 30 for p in gcd)  # the generator config passed through
    held_out = env.held_out()
    assert {p.meta["entry"]["question"] for p in prompts} != {held_out.sample(random.Random(i)).meta["entry"]["question"]
                                                            for i in range(50)}


def test_reasoning_gym_template_uses_entry_metadata():
    env = make_env(EnvSection(name="reasoning_gym", options={"tasks": {"spell_backward": 1.0}, "size": 20,
                                                             "template": "spell:{word}="}), 32)
    prompt = env.sample(random.Random(2))
    assert prompt.text == f"<bos>spell:{prompt.meta['entry']['metadata']['word']}="
    with pytest.raises(ConfigError, match=r"env.options.template = 'x{nope}' cannot be filled.*word"):
        make_env(EnvSection(name="reasoning_gym", options={"tasks": {"spell_backward": 1.0}, "template": "x{nope}"}), 32)


@pytest.mark.parametrize("options, message", [
    ("tasks = {spel_backward = 1.0}", r"env.options.tasks.spel_backward is not a reasoning-gym task \(did you mean "
                                      r"spell_backward\?\)"),
    ("tasks = {gcd = 0}", r"env.options.tasks.gcd: weight = 0 must be a number > 0"),
    ("tasks = {gcd = {bogus = 3}}", r"env.options.tasks.gcd: reasoning-gym rejected its config \{'bogus': 3\}"),
    ("tasks = {gcd = 1}\nsizes = 3", r"env.options.sizes is not an option of env reasoning_gym"),
    ("size = 3", r"env.options.tasks must be a table"),
])
def test_reasoning_gym_bad_options_fail_at_config_load(options, message):
    with pytest.raises(ConfigError, match=message):
        load_as_reel_run(env_config("reasoning_gym", options))


def test_answer_extraction_rule():
    assert extract_answer("think... <answer> 42 </answer> more <answer>7</answer>") == "7"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("<answer>a</answer> \\boxed{b}") == "a"  # the tag wins
    assert extract_answer("  plain 12 ") == "plain 12"
    assert extract_answer("\\boxed{unbalanced") == "\\boxed{unbalanced"


# ---- math-verify and verl-style datasets ---------------------------------------------------------

@pytest.mark.parametrize("truth, answer", [
    ("$\\frac{1}{2}$", "$0.5$"), ("$\\frac{1}{2}$", "$\\frac{2}{4}$"), ("$3$", "$\\boxed{3}$"), ("$3$", "$4$"),
    ("\\boxed{2}", "the answer is \\boxed{2}"), ("$x^2$", "$x \\cdot x$"), ("$7$", "no number"),
])
def test_math_verify_matches_the_library(truth, answer):
    from math_verify import parse, verify

    assert math_verify("", answer, truth) == float(verify(parse(truth), parse(answer)))


def test_math_verify_reads_bare_latex_and_plain_numbers():
    assert math_verify("", "0.5", "\\frac{1}{2}") == 1.0
    assert math_verify("", "1.41421356", "\\sqrt{2}") == 1.0
    assert math_verify("", "1+x", "x+1") == 1.0
    assert math_verify("", "0.6", "\\frac{1}{2}") == 0.0


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


VERL_ROWS = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"what is {a} + {a}?"}],
              "reward_model": {"style": "rule", "ground_truth": str(2 * a)}, "extra_info": {"index": a}}
             for a in range(1, 9)]


def test_verl_layout_with_a_verl_compute_score_unchanged(tmp_path):
    import task_fixtures

    path = write_jsonl(tmp_path / "train.jsonl", VERL_ROWS)
    env = make_env(EnvSection(name="dataset", options={"path": str(path), "reward": "task_fixtures:compute_score"}), 16)
    rng = random.Random(0)
    for _ in range(6):
        prompt = env.sample(rng)
        row = VERL_ROWS[prompt.meta["index"]]
        assert prompt.text == "<bos>" + row["prompt"][0]["content"]
        assert prompt.meta["data_source"] == "openai/gsm8k" and prompt.meta["info"] == row["extra_info"]
        truth = row["reward_model"]["ground_truth"]
        for text in (f"so #### {truth}", f"#### {int(truth) + 1}", truth):
            expected = task_fixtures.compute_score(row["data_source"], text, truth, row["extra_info"])
            assert env.score(text, prompt.meta) == expected  # '#' is outside the character tokenizer
        assert env.reward(prompt, ids(truth)) == 0.0  # the whole turn goes to the function: no "####"


def test_plain_layout_parquet_exact_and_math_verify(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "half of one?", "answer": "\\frac{1}{2}"}, {"prompt": "two and two?", "answer": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    for reward, answer, expected in (("math_verify", "0.5", 1.0), ("exact", "0.5", 0.0), ("exact", "\\frac{1}{2}", 1.0)):
        env = make_env(EnvSection(name="dataset", options={"path": str(tmp_path), "reward": reward}), 16)
        prompt = next(p for p in (env.sample(random.Random(i)) for i in range(20)) if p.meta["index"] == 0)
        assert env.score(answer, prompt.meta) == expected


def test_dataset_sha256_changes_with_the_file(tmp_path):
    from reel.runtime.config.run import from_dict
    from reel.runtime.config.data_files import dataset_sha256

    path = write_jsonl(tmp_path / "d.jsonl", VERL_ROWS)
    config = from_dict({"env": {"name": "dataset", "options": {"path": str(path)}}})
    before = dataset_sha256(config)
    assert before == make_env(config.env, 16).sample(random.Random(0)).meta["dataset_sha256"]
    write_jsonl(path, VERL_ROWS[:-1])
    assert dataset_sha256(config) != before


def test_reward_function_that_raises_or_returns_a_non_number_is_a_reward_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "a", "extra_info": {"bonus": 0.5}}])
    env = make_env(EnvSection(name="dataset", options={"path": str(path), "reward": "task_fixtures:raising_score"}), 16)
    prompt = env.sample(random.Random(0))
    assert env.reward(prompt, ids("fine")) == 1.0
    with pytest.raises(RewardError, match=r"reward function 'task_fixtures:raising_score' raised ZeroDivisionError: "
                                          r"the user's scorer divided by zero"):
        env.reward(prompt, ids("boom"))
    env = make_env(EnvSection(name="dataset", options={"path": str(path), "reward": "task_fixtures:text_score"}), 16)
    with pytest.raises(RewardError, match=r"returned 'yes' \(str\), not a number"):
        env.reward(prompt, ids("a"))
    env = make_env(EnvSection(name="dataset", options={"path": str(path), "reward": "task_fixtures:compute_score_dict"}), 16)
    assert env.reward(prompt, ids("a")) == 1.5  # verl's dict form: its "score"


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "q"}], r"d.jsonl row 0 has neither `answer` nor `reward_model.ground_truth`"),
    ([{"question": "q", "answer": "a"}], r"d.jsonl row 0 has no `prompt` column"),
    ([{"prompt": "q", "answer": "a"}, {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}],
     r"d.jsonl row 1 has `reward_model` but no `data_source` column"),
    ([{"prompt": [{"role": "system", "content": "s"}], "answer": "a"}], r"d.jsonl row 0: `prompt` must be a string or chat"),
])
def test_dataset_with_missing_columns_fails_at_config_load(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=message):
        load_as_reel_run(env_config("dataset", f'path = "{path}"'))


@pytest.mark.parametrize("options, message", [
    ('path = "/nonexistent/x.jsonl"', r"env.options.path = '/nonexistent/x.jsonl' does not exist"),
    ('path = "PATH"\nreward = "close_enough"', r"env.options.reward = 'close_enough' is unknown"),
    ('path = "PATH"\nreward = "task_fixtures:nope"', r"'task_fixtures' has no attribute 'nope'"),
    ('path = "PATH"\nshuffle = 1', r"env.options.shuffle is not an option of env dataset"),
])
def test_dataset_bad_options_fail_at_config_load(tmp_path, options, message):
    path = write_jsonl(tmp_path / "d.jsonl", VERL_ROWS)
    with pytest.raises(ConfigError, match=message):
        load_as_reel_run(env_config("dataset", options.replace("PATH", str(path))))


def test_an_env_returning_a_non_numeric_reward_is_a_reward_error():
    import asyncio

    import torch

    from reel.producers.builtin_engine import BuiltinEngine
    from reel.producers.engine import SamplingParams
    from reel.producers.envs.reverse_text import ReverseText
    from reel.producers.episode import run_group, scored_group
    from reel.producers.tool_calls import ToolCalls
    from reel.runtime.model.config import MoEConfig
    from reel.runtime.model.model import MoEModel

    class TextReward(ReverseText):  # a user's env with a bug: its reward is a string
        def reward(self, prompt, completion_ids):
            return "1.0"

    env = TextReward(TOK, min_len=3, max_len=3)
    torch.manual_seed(0)
    model = MoEModel(MoEConfig(vocab_size=TOK.vocab_size)).eval()

    async def go():
        async with BuiltinEngine(model, max_batch=4) as engine:
            prompt = env.sample(random.Random(0))
            params = SamplingParams(n=2, max_tokens=3, stop_token_ids=TOK.stop_ids, seed=1)
            calls = ToolCalls(4, 10.0)
            assert await scored_group(engine, env, prompt, params, calls, "test") is None  # left out, and logged
            await run_group(engine, env, prompt, params, calls)

    with pytest.raises(RewardError, match=r"env reverse_text returned the reward '1.0' \(str\), not a number"):
        asyncio.run(go())


# ---- verifiers 0.4 (more in tests/producers/test_verifiers.py) -----------------------------------

def test_verifiers_env_name_carries_the_id_and_bad_input_fails_at_config_load():
    pytest.importorskip("verifiers.v1", reason="the `tasks` extra (pip install '.[tasks]')")
    env = loads(env_config("verifiers:vf-fixtures", 'args = {rows = 3}')).env
    assert make_env(env, 8).env_id == "vf-fixtures" and len(make_env(env, 8).tasks) == 3
    cases = [
        ("verifiers:vf-fixtures", 'id = "other"', r"env.options.id = 'other' differs from env.name"),
        ("verifiers", 'id = "no-such-env-pkg"', r"no installed package provides module 'no_such_env_pkg'"),
        ("verifiers:vf-fixtures", 'args = {kind = "raises"}',
         r"its taskset's load\(\) raised FileNotFoundError: the taskset's data file words.jsonl is missing"),
        ("verifiers:vf-fixtures", 'args = {rows = 0}', r"its taskset has no tasks"),
        ("verifiers:vf-fixtures", 'split = "eval"', r"env.options.split is not an option of env verifiers"),
    ]
    for name, options, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_as_reel_run(env_config(name, options))
