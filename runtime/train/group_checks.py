"""Is a group trainable at all? Checked before it enters a batch, so a group that would make the step
fail (an out-of-vocabulary token, logprobs shorter than the tokens, a NaN) is dropped with a reason
(StepCommitted.dropped) and acknowledged, instead of crashing the trainer and staying pending for
every resume to crash on again. Routing has its own check (runtime/train/batch.py routing_problem).
"""

from __future__ import annotations

import math

import numpy as np

from reel.bus.errors import ReelError
from reel.bus.events import Sample, Tensor, Trajectory

__all__ = ["group_problem"]

_INT = ("uint8", "uint16", "int32", "int64")  # the integer dtypes a Tensor can carry (bus/events.py)
_FLOAT = ("float16", "bfloat16", "float32", "float64")


def group_problem(trajectory: Trajectory, vocab_size: int) -> str | None:
    """Why `trajectory` cannot be trained by a model of `vocab_size` tokens, or None."""
    try:
        prompt = _vector(trajectory.prompt, _INT, "prompt")
        if prompt.size == 0:
            return "the prompt is empty"
        if problem := _out_of_vocab(prompt, vocab_size, "the prompt"):
            return problem
        if not trajectory.samples:
            return "the group has no samples"
        for i, sample in enumerate(trajectory.samples):
            if problem := _sample_problem(sample, vocab_size, f"sample {i}"):
                return problem
    except ReelError as exc:  # a tensor whose bytes do not fit its dtype and shape
        return str(exc)
    return None


def _sample_problem(sample: Sample, vocab_size: int, name: str) -> str | None:
    tokens = _vector(sample.tokens, _INT, f"{name} tokens")
    logprobs = _vector(sample.logprobs, _FLOAT, f"{name} logprobs")
    if tokens.size == 0:
        return f"{name} has no tokens"
    if problem := _out_of_vocab(tokens, vocab_size, name):
        return problem
    if logprobs.shape != tokens.shape:
        return f"{name} has {logprobs.size} logprobs for {tokens.size} tokens"
    if not np.isfinite(logprobs.astype(np.float32)).all():
        return f"{name} has a non-finite logprob"
    if not math.isfinite(sample.reward):
        return f"{name} has a non-finite reward ({sample.reward})"
    if any(not 0 <= first <= tokens.size for first, _ in sample.spans):
        return f"{name} has a policy span outside its {tokens.size} tokens"
    if any(not 0 <= first <= end <= tokens.size for first, end in sample.env_spans):
        return f"{name} has an env span outside its {tokens.size} tokens"
    return None


def _vector(tensor: Tensor, dtypes: tuple[str, ...], name: str) -> np.ndarray:
    if tensor.dtype not in dtypes or len(tensor.shape) != 1:
        raise ReelError(f"{name} is a {tensor.dtype} tensor of shape {tensor.shape}, not a vector of "
                        f"{'integers' if dtypes is _INT else 'floats'}")
    if tensor.dtype == "bfloat16":  # numpy has no bfloat16: only its bit pattern is here
        return (tensor.numpy().astype(np.uint32) << 16).view(np.float32)
    return tensor.numpy()


def _out_of_vocab(ids: np.ndarray, vocab_size: int, name: str) -> str | None:
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        return f"{name} has token id {high if high >= vocab_size else low}, outside the vocabulary of {vocab_size}"
    return None
