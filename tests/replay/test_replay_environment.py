"""A replay that does not reproduce names the layout keys and library versions that changed."""

from __future__ import annotations

import msgspec
import pytest
import torch

from reel.bus.events import RunStarted, StepCommitted, StepTiming, decode, encode
from reel.runtime.train import environment
from reel.runtime.config.run import config_hash, from_dict
from reel.runtime.train.initial_policy import code_version
from reel.runtime.train.reexecute import ReplayMismatch, check_reproduced
from reel.runtime.train.step import StepResult

CONFIG = from_dict({"trainer": {"batch_groups": 2}, "rollout": {"concurrency": 2}})


def _commit(**fields) -> StepCommitted:
    return StepCommitted(run="r", producer="trainer:0", seq=1, step=3, version=3, groups=[], dropped=[], loss=0.0,
                         grad_norm=0.0, weights_sha256="a" * 64, timing=StepTiming(0.0, 0.0, 0.0),
                         config_hash=config_hash(CONFIG), code_version=code_version(), **fields)


def _other_result() -> StepResult:
    return StepResult(loss=0.0, grad_norm=0.0, weights_sha256="b" * 64, metrics={}, staleness={})


def test_environment_is_recorded_and_survives_the_wire():
    here = environment.library_versions()
    assert here["torch"] == torch.__version__ and set(here) == {"torch", "cuda", "nccl", "vllm"}
    assert environment.layout(CONFIG) == {"ranks": 1, "expert_parallel": 1, "context_parallel": 1}
    assert environment.cpu_count() == len(environment.cpus()) >= 1 and environment.nice() >= 0
    started = RunStarted(run="r", producer="p", seq=0, config_toml="", seed=1, code_version="c", model_config={},
                         layout=environment.layout(CONFIG), libraries=here, cpu_count=environment.cpu_count(),
                         cpus=environment.cpus())
    assert decode(encode(started)) == started
    # A log from before the cores were recorded reads them as unknown.
    old = msgspec.msgpack.decode(encode(started))
    del old["cpus"]
    assert decode(msgspec.msgpack.encode(old)).cpus == []
    assert decode(encode(_commit(layout={"ranks": 2}, libraries=here))).libraries == here


def test_mismatch_names_each_layout_key_and_library_that_changed():
    recorded = environment.library_versions() | {"torch": "2.0.1", "nccl": "2.18.1"}
    commit = _commit(layout={"ranks": 1, "expert_parallel": 2, "context_parallel": 1}, libraries=recorded)
    with pytest.raises(ReplayMismatch) as caught:
        check_reproduced(commit, _other_result(), CONFIG)
    message = str(caught.value)
    assert message.startswith("step 3 re-executed to different weights (")
    assert "trainer.expert_parallel 2 at the commit, 1 here" in message
    assert f"torch 2.0.1 at the commit, {torch.__version__} here" in message
    assert f"nccl 2.18.1 at the commit, {environment.library_versions()['nccl'] or 'absent'} here" in message
    assert "trainer.ranks" not in message and "not deterministic" not in message


def test_same_environment_still_blames_the_machine():
    commit = _commit(layout=environment.layout(CONFIG), libraries=environment.library_versions())
    with pytest.raises(ReplayMismatch, match="not deterministic on this machine"):
        check_reproduced(commit, _other_result(), CONFIG)
