"""Users' task code for tests/producers/test_tasks.py: verl-style reward functions and verifiers environments
(classic API), importable by name ("task_fixtures:compute_score", verifiers id "task_fixtures")."""

from __future__ import annotations

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's gsm8k scorer, as published: the number after the last "####", 1.0 if it equals the truth."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == ground_truth else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    """verl lets a scorer return a dict with "score"; the bonus comes from extra_info."""
    return {"score": float(solution_str.strip() == ground_truth) + extra_info.get("bonus", 0.0), "acc": 1.0}


def raising_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.strip() == "boom":
        raise ZeroDivisionError("the user's scorer divided by zero")
    return 1.0


def text_score(data_source, solution_str, ground_truth, extra_info=None):
    return "yes"  # not a number


def load_environment(kind: str = "single", rows: int = 4):
    """A SingleTurnEnv ("single"), a guessing MultiTurnEnv ("multi"), a ToolEnv ("tool") or an EnvGroup ("group")."""
    import verifiers as vf
    from datasets import Dataset

    data = Dataset.from_list([{"question": f"reverse {w}", "answer": w[::-1]}
                              for w in ["abc", "dog", "sun", "moon", "tree", "lamp"][:rows]])

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if completion[-1].content.strip() == answer else 0.0

    def short(completion, **kwargs) -> float:
        return 1.0 if len(completion[-1].content) <= 4 else 0.0

    rubric = vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5])
    if kind == "single":
        return vf.SingleTurnEnv(dataset=data, rubric=rubric)
    if kind == "multi":
        return _guess_class()(dataset=data, rubric=vf.Rubric(funcs=[correct]), max_turns=3)
    if kind == "tool":
        def reverse(text: str) -> str:
            """Reverse a string."""
            return text[::-1]

        return vf.ToolEnv(dataset=data, tools=[reverse], rubric=vf.Rubric(funcs=[correct]), max_turns=3)
    if kind == "group":  # an EnvGroup: several envs behind one, which Reel refuses
        return vf.EnvGroup(envs=[vf.SingleTurnEnv(dataset=data, rubric=rubric)] * 2, env_names=["a", "b"])
    raise ValueError(f"unknown kind {kind!r}")


def _guess_class():
    """Built on first use: importing this module must not import verifiers."""
    import verifiers as vf

    class Guess(vf.MultiTurnEnv):
        """The user says "again" after a wrong answer; a right one ends the episode."""

        async def env_response(self, messages, state, **kwargs):
            return [vf.UserMessage(role="user", content="again")]

        @vf.stop
        async def solved(self, state, **kwargs) -> bool:
            steps = state["trajectory"]
            return bool(steps) and steps[-1]["completion"][-1].content.strip() == state["answer"]

    return Guess



def flaky_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match, except that rows marked `explode` make the scorer raise (a user's bug)."""
    if extra_info.get("explode"):
        raise KeyError("the scorer's lookup table has no entry for this row")
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """Another reward for the same rows (re-scoring tests): the answer's length, capped at 6, over 6."""
    return min(len(solution_str.strip()), 6) / 6
