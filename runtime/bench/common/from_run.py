"""`reel bench r3|fp8 --from-run DIR`: the benches on a trained run instead of random weights.

The policy is the run's latest published weights; the prompts are the run's own (the newest
logged ones of the most common prompt length, since the bench decodes prompts as one block), and
completions are scored up to and including their end-of-sequence token, as the trainer scores them.
Reads the log and the blob store only.

Legend: B prompts, P prompt tokens, G completion tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.errors import ReelError
from reel.bus.events import Trajectory, WeightsPublished
from reel.bus.run_log import RunLog
from reel.runtime.train.initial_policy import load_initial_model
from reel.runtime.config.run import load_run_config
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.weights.load import version_bytes


class TrainedRun(NamedTuple):
    model: MoEModel  # at the latest published weights
    version: int
    prompts_BP: torch.Tensor
    new_tokens: int  # the run's rollout.max_tokens
    eos: int | None  # end-of-sequence token, from a logged sample that stopped; None if none did


def load_trained_run(run_dir: Path, prompts: int) -> TrainedRun:
    config = load_run_config(run_dir)  # one sentence when run_dir is not a run
    with RunLog(run_dir, readonly=True) as run_log:
        weights = [e for _, e in run_log.events("weights") if isinstance(e, WeightsPublished)]
        trajectories = [e for _, e in run_log.events("trajectories") if isinstance(e, Trajectory)]
    if not weights or not trajectories:
        raise ReelError(f"{run_dir} has no published weights or no logged rollouts yet; run it first")
    latest = max(weights, key=lambda e: e.version)
    model = load_initial_model(run_dir)
    load_state_dict_bytes(model, version_bytes(BlobStore(run_dir / "blobs"), latest.weights, latest.format))
    length = Counter(t.prompt.shape[0] for t in trajectories).most_common(1)[0][0]
    chosen = [t.prompt.numpy() for t in reversed(trajectories) if t.prompt.shape[0] == length][:prompts]
    stopped = [s.tokens.numpy()[-1] for t in trajectories for s in t.samples if s.finish_reason == "stop"]
    return TrainedRun(model, latest.version, torch.tensor([list(p) for p in chosen], dtype=torch.long),
                      config.rollout.max_tokens, int(stopped[0]) if stopped else None)


def completion_mask(tokens_BT: torch.Tensor, new_tokens: int, eos: int | None) -> torch.Tensor:
    """[B, G] True for completion tokens up to and including the first eos."""
    completion_BG = tokens_BT[:, -new_tokens:]
    if eos is None:
        return torch.ones_like(completion_BG, dtype=torch.bool)
    ended_before_BG = (completion_BG == eos).long().cumsum(1) - (completion_BG == eos).long()
    return ended_before_BG == 0
