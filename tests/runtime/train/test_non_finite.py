"""Non-finite values never become a policy version.

A worker refuses a group with a NaN/inf reward or logprob (dead-lettered with the reason, replaced
by a new group), and train_step refuses a step whose loss, gradient or new weights are not finite
(NonFiniteStep names the step and the first offending tensor; the trainer publishes nothing).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from reel.bus.events import RunFinished, StepCommitted, Trajectory, WeightsPublished
from reel.bus.run_log import RunLog
from reel.producers.episode import Episode, non_finite
from reel.runtime.train.batch import build_batch
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.run import load
from reel.runtime.weights.load import version_bytes
from reel.runtime.train.distributed import LOCAL
from reel.runtime.train.finite import NonFiniteStep, check_weights
from reel.runtime.launch.cli import main
from reel.runtime.train.step import train_step
from runbuilder import e2e_config
from train_setup import step_config, random_groups, fresh_state

torch.set_num_threads(1)

# A user env: reverse_text whose first answer in a rollout worker is a NaN reward (a marker file,
# named by $NAN_ONCE_MARKER, makes it once across the run's processes; the warm-start is left alone).
NAN_ONCE_SOURCE = '''
import os
import sys

from reel.producers.envs import Finish
from reel.producers.envs.reverse_text import ReverseText


class NaNOnce(ReverseText):
    def respond(self, prompt, turns):
        reply = super().respond(prompt, turns)
        if "rollout" not in sys.argv:
            return reply
        try:
            os.close(os.open(os.environ["NAN_ONCE_MARKER"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return reply
        return Finish(float("nan"))


def make(section, tokenizer, max_tokens):
    return NaNOnce.from_section(section, tokenizer, max_tokens)
'''


def test_worker_check_names_sample_and_value():
    good = Episode(seed=1, tokens=[3, 4], logprobs=[-0.1, -2.0], reward=0.5)
    assert non_finite([good]) is None
    assert non_finite([good, Episode(seed=2, reward=math.nan)]) == "sample 1: the env returned reward nan"
    bad = Episode(seed=3, tokens=[3, 4, 5], logprobs=[-0.1, -math.inf, math.nan], reward=1.0)
    assert non_finite([bad]) == "sample 0: the engine returned logprob -inf at completion token 1"


def test_train_step_refuses_a_non_finite_loss_and_leaves_the_weights():
    config = step_config()
    state = fresh_state(config)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    batch = build_batch(random_groups(state.model, 1))
    row, col = batch.loss_mask_BT.nonzero()[0].tolist()
    batch.advantages_BT[row, col] = math.nan  # on a trained token: the loss is NaN
    with pytest.raises(NonFiniteStep, match=r"^step 1: the loss is nan; nothing was committed"):
        train_step(state, batch, config)
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())


def test_train_step_names_the_first_non_finite_gradient():
    config = step_config()
    state = fresh_state(config)
    batch = build_batch(random_groups(state.model, 1))
    name, param = list(state.model.named_parameters())[3]
    param.register_hook(lambda g: torch.full_like(g, math.inf))  # a finite loss whose backward overflows here
    with pytest.raises(NonFiniteStep, match=rf"^step 1: the gradient norm is (inf|nan), first non-finite gradient: "
                                            rf"{name};"):
        train_step(state, batch, config)


def test_weight_check_names_the_first_non_finite_weight():
    model = fresh_state(step_config()).model
    check_weights(7, model, LOCAL)
    name, param = list(model.named_parameters())[5]
    with torch.no_grad():
        param.view(-1)[2] = math.inf
    with pytest.raises(NonFiniteStep, match=rf"^step 7: the updated weights are not finite, first: {name};"):
        check_weights(7, model, LOCAL)


@pytest.mark.slow
def test_a_nan_reward_is_dead_lettered_and_the_run_stays_finite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "nan_once_env.py").write_text(NAN_ONCE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("NAN_ONCE_MARKER", str(tmp_path / "nan_given"))
    # Every version kept (retention would delete the old ones), so every published weight can be checked.
    config = e2e_config(tmp_path / "nan.toml", "nanonce", 3, {"env": {"name": "nan_once_env:make"},
                                                               "log": {"keep_weights_every": 1}})
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    assert (tmp_path / "nan_given").exists()  # the env did return its NaN
    assert "refused: sample" in (run_dir / "roles" / "rollout-0.log").read_text()
    blobs = run_blobs(run_dir, load(run_dir / "config.toml"))
    with RunLog(run_dir, readonly=True) as log:
        commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]
        published = [e for _, e in log.events("weights") if isinstance(e, WeightsPublished)]
        rewards = [s.reward for _, e in log.events("trajectories") if isinstance(e, Trajectory) for s in e.samples]
        (finished,) = [e for _, e in log.events("control") if isinstance(e, RunFinished)]
    assert [c.step for c in commits] == [1, 2, 3]
    assert all(math.isfinite(c.loss) and math.isfinite(c.grad_norm) for c in commits)
    assert all(math.isfinite(r) for r in rewards)
    assert finished.dead_letters == 1
    assert [p.version for p in published] == [0, 1, 2, 3]
    for p in published:
        tensors = st_load(version_bytes(blobs, p.weights, p.format))
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), f"version {p.version}"
