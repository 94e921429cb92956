"""dataset: prompts and ground truths from a local JSONL or parquet file (or a directory of them).

    [env]
    name = "dataset"
    [env.options]
    path = "data/train.parquet"   # a .jsonl / .parquet file, or a directory of them (read in name order)
    reward = "math_verify"        # "exact" | "math_verify" | "package.module:function" (verl compute_score)
    eval_path = ""                # held-out rows for the eval role (default: the same rows)

Two column layouts, read as they are:
- verl: `prompt` (chat messages), `reward_model.ground_truth`, `data_source`, optional `extra_info`;
- plain: `prompt` (a string or chat messages) and `answer`, optional `data_source` and `extra_info`.

Chat messages become one user message: a system message's content, a blank line, the last user
message's content. With the character tokenizer the prompt is folded into its alphabet.

The reward: "exact" and "math_verify" score the extracted answer (producers/envs/answers.py); a
function gets the whole model turn as verl's `solution_str`, since verl functions extract their own.
A function that raises or returns a non-number makes that group dead-lettered with the reason
(producers/envs/rewards.py). The file's sha256 is recorded in RunStarted (runtime/config/data_files.py)
and each Trajectory's meta holds the row's data_source, ground truth, extra_info and row index, so
the log can be re-scored offline.

Epochs: training draws walk the rows in epochs. Draw n (counted over the run and its workers,
producers/draws.py) is row order(e)[n mod N] of epoch e = n // N, where order(e) is a permutation of
the N rows seeded by (run.seed, e): every row once per epoch, each epoch in its own order, and the
same rows at the same draws after a resume. The epoch is in the Trajectory's meta (`epoch`, `draw`)
and `reel top` / Prometheus show the newest (reel_dataset_epoch). Eval and warm-start prompts draw
rows at random with their own rng (`sample`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson

from reel.producers.envs import rewards
from reel.producers.envs.answers import extract_answer, fold
from reel.producers.envs.base import Env, Prompt
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.data_files import data_files, files_sha256
from reel.runtime.tokenizer import CharTokenizer, Tokenizer

KEY = "env.options"
OPTIONS = {"path", "reward", "eval_path"}


class Dataset(Env):
    name = "dataset"
    counts_draws = True

    tokenizer: Tokenizer
    path: str
    reward_name: str
    reward_fn: rewards.RewardFn
    eval_path: str
    rows: list[dict[str, Any]]  # {"text", "truth", "data_source", "extra_info"}
    sha256: str
    _orders: dict[tuple[int, int], list[int]]  # (seed, epoch) -> that epoch's row order

    def __init__(self, tokenizer: Tokenizer, *, path: str, reward: str = "exact", eval_path: str = "") -> None:
        self.tokenizer, self.path, self.reward_name, self.eval_path = tokenizer, path, reward, eval_path
        self.reward_fn = rewards.resolve(reward)
        files = data_files(path)
        self.rows = [row for f in files for row in read_rows(f)]
        if not self.rows:
            raise ConfigError(f"{KEY}.path = {path!r} has no rows")
        self.sha256 = files_sha256(files)
        self._orders = {}

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> Dataset:
        return cls(tokenizer, **section.options)

    def held_out(self) -> Dataset:
        if not self.eval_path:
            return self
        return Dataset(self.tokenizer, path=self.eval_path, reward=self.reward_name)

    def sample(self, rng: random.Random) -> Prompt:
        return self._prompt(rng.randrange(len(self.rows)), {})

    def draw(self, rng: random.Random, index: int, seed: int) -> Prompt:
        epoch, position = divmod(index, len(self.rows))
        return self._prompt(self.order(seed, epoch)[position], {"epoch": epoch, "draw": index})

    def order(self, seed: int, epoch: int) -> list[int]:
        """Epoch `epoch`'s permutation of the rows, seeded by (run seed, epoch) alone."""
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) > 2:  # draws move forward: keep the newest few epochs
                self._orders.pop(min(self._orders, key=lambda k: k[1]))
            order = list(range(len(self.rows)))
            random.Random(f"reel-dataset-epoch:{seed}:{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def _prompt(self, index: int, extra: dict[str, int]) -> Prompt:
        row = self.rows[index]
        text = fold(row["text"]) if isinstance(self.tokenizer, CharTokenizer) else row["text"]
        ids = self.tokenizer.prompt_ids(text)
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=row["truth"],
                      meta={"env": self.name, "index": index, "data_source": row["data_source"],
                            "answer": row["truth"], "info": row["extra_info"], "dataset_sha256": self.sha256,
                            **extra})

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text, _ = self.completion_text(completion_ids)
        return self.score(text, prompt.meta)

    def score(self, text: str, meta: dict[str, Any]) -> float:
        """The reward of a model turn's text for a prompt's meta (also what offline re-scoring calls)."""
        solution = text if self.reward_name not in rewards.BUILTIN else extract_answer(text)
        return rewards.score(self.reward_fn, self.reward_name, meta["data_source"], solution, meta["answer"],
                             meta["info"])


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one file in the env's shape; ConfigError naming the file, row and missing column."""
    return [row_of(raw, path, i) for i, raw in enumerate(_raw_rows(path))]


def _raw_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
            raise ConfigError(f"{KEY}.path: {path} is not a readable parquet file ({exc})") from exc
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{KEY}.path: {path} line {number} is not JSON ({exc})") from exc
    return rows


def row_of(raw: Any, path: Path, index: int) -> dict[str, Any]:
    """A raw row in the verl or the plain layout as {"text", "truth", "data_source", "extra_info"}."""
    where = f"{KEY}.path: {path} row {index}"
    if not isinstance(raw, dict) or "prompt" not in raw:
        raise ConfigError(f"{where} has no `prompt` column; give `prompt` (a string or chat messages) and "
                          "`answer`, or verl's `prompt`, `reward_model.ground_truth` and `data_source`")
    if "reward_model" in raw:
        truth = (raw["reward_model"] or {}).get("ground_truth")
        if truth is None:
            raise ConfigError(f"{where} has `reward_model` without `ground_truth` (verl layout)")
        if "data_source" not in raw:
            raise ConfigError(f"{where} has `reward_model` but no `data_source` column (verl layout)")
    elif "answer" in raw:
        truth = raw["answer"]
    else:
        raise ConfigError(f"{where} has neither `answer` nor `reward_model.ground_truth`; add the ground truth")
    return {"text": prompt_text(raw["prompt"], where), "truth": str(truth),
            "data_source": str(raw.get("data_source") or ""), "extra_info": dict(raw.get("extra_info") or {})}


def prompt_text(prompt: Any, where: str) -> str:
    """A prompt string, or chat messages as one user message (module docstring)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        system = [m["content"] for m in prompt if m.get("role") == "system"]
        user = [m["content"] for m in prompt if m.get("role") == "user"]
        if user:
            return "\n\n".join([*system[:1], user[-1]])
    raise ConfigError(f"{where}: `prompt` must be a string or chat messages with a user message "
                      f"[{{role = \"user\", content = ...}}], not {str(prompt)[:80]}")


def check(section: EnvSection) -> None:
    """Config-load check: option keys, the reward's name, every row's columns (the file is read)."""
    unknown = sorted(set(section.options) - OPTIONS)
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]} is not an option of env dataset; use {', '.join(sorted(OPTIONS))}")
    rewards.resolve(str(section.options.get("reward", "exact")))
    for key in ("path", "eval_path"):
        if key == "path" or section.options.get(key):
            for f in data_files(str(section.options.get(key, "")), f"{KEY}.{key}"):
                read_rows(f)
