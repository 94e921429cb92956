"""Users' task code for tests/producers/test_tasks.py: verl-style reward functions, importable by name
("task_fixtures:compute_score"). The verifiers environment fixture is vf_fixtures."""

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


def flaky_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match, except that rows marked `explode` make the scorer raise (a user's bug)."""
    if extra_info.get("explode"):
        raise KeyError("the scorer's lookup table has no entry for this row")
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """Another reward for the same rows (re-scoring tests): the answer's length, capped at 6, over 6."""
    return min(len(solution_str.strip()), 6) / 6
