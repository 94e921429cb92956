"""reasoning_gym: procedural tasks of the reasoning-gym package, scored by each dataset's own `score_answer`.

    [env]
    name = "reasoning_gym"
    [env.options]
    tasks = {spell_backward = 1.0, gcd = {weight = 0.5, min_value = 1, max_value = 50}}
    size = 1000              # entries generated per task (the pool prompts are drawn from)
    seed = 0                 # reasoning-gym's dataset seed; the eval role's held-out pool uses seed + 1
    template = "{question}"  # the prompt's user message; {question} and any metadata key of the entry

A task's value is its weight, or a table with `weight` (default 1) and the generator's own config
keys (passed to `reasoning_gym.create_dataset(name, size=, seed=, **config)`). Each prompt picks a
task by weight, then an entry of its pool. The reward is `score_answer(extract_answer(text), entry)`
(producers/envs/answers.py has the extraction rule). With the character tokenizer the prompt is
folded into its alphabet (lower case, other characters as spaces) and entries whose answer is not
already in it are left out of the pool.

A Trajectory's meta holds the task and the whole entry (question, answer, metadata), so the log can
be re-scored offline (`rescore`).
"""

from __future__ import annotations

import bisect
import itertools
import random
from typing import Any

from reel.producers.envs.answers import extract_answer, fold
from reel.producers.envs.base import Env, Prompt
from reel.producers.envs.rewards import RewardError, as_reward
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import CharTokenizer, Tokenizer

KEY = "env.options"
OPTIONS = {"tasks", "size", "seed", "template"}


class Task:
    """One reasoning-gym generator: its pool of entries and its scorer."""

    name: str
    weight: float
    config: dict[str, Any]  # the generator's config keys (env.options.tasks.NAME without weight)
    dataset: Any  # a reasoning_gym ProceduralDataset
    entries: list[dict[str, Any]]

    def __init__(self, name: str, weight: float, config: dict[str, Any], dataset: Any,
                 entries: list[dict[str, Any]]) -> None:
        self.name, self.weight, self.config, self.dataset, self.entries = name, weight, config, dataset, entries


class ReasoningGym(Env):
    name = "reasoning_gym"

    tokenizer: Tokenizer
    tasks: list[Task]
    template: str
    size: int
    seed: int
    _cumulative: list[float]  # running sum of task weights (sampling by weight)

    def __init__(self, tokenizer: Tokenizer, *, tasks: dict[str, Any], size: int = 1000, seed: int = 0,
                 template: str = "{question}") -> None:
        self.tokenizer, self.template, self.size, self.seed = tokenizer, template, size, seed
        if size < 1:
            raise ConfigError(f"{KEY}.size = {size} must be at least 1")
        specs = parse_tasks(tasks)
        self.tasks = [self._task(name, weight, config) for name, (weight, config) in specs.items()]
        self._cumulative = list(itertools.accumulate(t.weight for t in self.tasks))

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> ReasoningGym:
        return cls(tokenizer, **section.options)

    def held_out(self) -> ReasoningGym:
        """The same tasks drawn from pools of another dataset seed (the eval role's prompts)."""
        tasks = {t.name: {"weight": t.weight, **t.config} for t in self.tasks}
        return ReasoningGym(self.tokenizer, tasks=tasks, size=self.size, seed=self.seed + 1, template=self.template)

    def _task(self, name: str, weight: float, config: dict[str, Any]) -> Task:
        dataset = create(name, self.size, self.seed, config)
        entries = [dict(dataset[i]) for i in range(self.size)]
        if isinstance(self.tokenizer, CharTokenizer):
            entries = [e for e in entries if fold(str(e["answer"])) == str(e["answer"])]
            if not entries:
                raise ConfigError(f"{KEY}.tasks.{name}: no answer of its {self.size} entries is written in the "
                                  "character tokenizer's alphabet; set model.path to a checkpoint with a tokenizer")
        for entry in entries[:1]:
            self._render(entry)  # a template naming a missing key fails at load, not mid-run
        return Task(name, weight, config, dataset, entries)

    def _render(self, entry: dict[str, Any]) -> str:
        try:
            text = self.template.format(question=entry["question"], **entry["metadata"])
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"{KEY}.template = {self.template!r} cannot be filled from a "
                              f"{entry['metadata'].get('source_dataset')} entry ({exc!r}); use {{question}} or "
                              f"one of {sorted(entry['metadata'])}") from exc
        return fold(text) if isinstance(self.tokenizer, CharTokenizer) else text

    def sample(self, rng: random.Random) -> Prompt:
        task = self.tasks[bisect.bisect_right(self._cumulative, rng.random() * self._cumulative[-1])]
        index = rng.randrange(len(task.entries))
        entry = task.entries[index]
        ids = self.tokenizer.prompt_ids(self._render(entry))
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=str(entry["answer"]),
                      meta={"env": self.name, "task": task.name, "index": index, "entry": entry})

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text, _ = self.completion_text(completion_ids)
        return self.score(prompt.meta["task"], extract_answer(text), prompt.meta["entry"])

    def score(self, task_name: str, answer: str, entry: dict[str, Any]) -> float:
        """The task's own score_answer; a scorer that raises or returns a non-number is a RewardError."""
        task = next(t for t in self.tasks if t.name == task_name)
        try:
            value = task.dataset.score_answer(answer, entry)
        except Exception as exc:  # the library's scorer failing is that sample's problem, not the run's
            raise RewardError(f"reasoning-gym {task_name}.score_answer raised {type(exc).__name__}: {exc}") from exc
        return as_reward(value, f"reasoning-gym {task_name}.score_answer")


def parse_tasks(tasks: Any) -> dict[str, tuple[float, dict[str, Any]]]:
    """env.options.tasks as name -> (weight, generator config); ConfigError for unknown names or bad weights."""
    from reasoning_gym.factory import DATASETS

    if not isinstance(tasks, dict) or not tasks:
        raise ConfigError(f"{KEY}.tasks must be a table of reasoning-gym task names and weights, "
                          "e.g. tasks = {spell_backward = 1.0}")
    parsed: dict[str, tuple[float, dict[str, Any]]] = {}
    for name, value in tasks.items():
        if name not in DATASETS:
            close = [d for d in sorted(DATASETS) if d.startswith(name[:3])][:5]
            raise ConfigError(f"{KEY}.tasks.{name} is not a reasoning-gym task"
                              + (f" (did you mean {', '.join(close)}?)" if close else "")
                              + f"; reasoning-gym {_version()} has {len(DATASETS)} tasks")
        config = dict(value) if isinstance(value, dict) else {"weight": value}
        weight = config.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(f"{KEY}.tasks.{name}: weight = {weight!r} must be a number > 0")
        parsed[name] = (float(weight), config)
    return parsed


def create(name: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    """reasoning_gym.create_dataset; a config the generator rejects is a ConfigError naming the task."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except Exception as exc:  # reasoning-gym raises TypeError, ValueError, AssertionError for bad configs
        raise ConfigError(f"{KEY}.tasks.{name}: reasoning-gym rejected its config {config}: "
                          f"{type(exc).__name__}: {exc}") from exc


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("reasoning-gym")


def check(section: EnvSection) -> None:
    """Config-load check: option keys, task names, weights and generator configs (one entry each)."""
    unknown = sorted(set(section.options) - OPTIONS)
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]} is not an option of env reasoning_gym; use {', '.join(sorted(OPTIONS))}")
    for name, (_, config) in parse_tasks(section.options.get("tasks")).items():
        create(name, 1, 0, config)  # one entry: a bad generator key fails here, not in a rollout worker
