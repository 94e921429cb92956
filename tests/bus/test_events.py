"""The event model: every type round-trips; decode raises only MalformedEvent on any bytes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reel.bus.events import (
    STREAM_OF, AnyEvent, BlobRef, CheckpointsPruned, DroppedGroup, GroupsDropped, MalformedEvent, RoutingTrace,
    RunFinished, RunStarted, Sample, StepCommitted, StepTiming, Tensor, Trajectory, WeightsPublished, WorkerStats,
    decode, encode, event_key, stream_key,
)

REF = BlobRef(uri="file:///tmp/blobs/ab/" + "ab" * 32, sha256="ab" * 32, nbytes=12)
IDS = Tensor.from_numpy(np.arange(5, dtype=np.int32))
LOGP = Tensor.from_numpy(-np.linspace(0, 1, 5, dtype=np.float32))
META = dict(run="r", producer="rollout:0", seq=3)

EVENTS: list[AnyEvent] = [
    RunStarted(**META, config_toml="[run]\nname = 'r'\n", seed=1, code_version="abc", model_config={"a": 1},
               config_hash="h", init_reward=0.4),
    WeightsPublished(**META, version=2, step=2, weights=REF),
    Trajectory(**META, group_id="0-0-1", env="reverse_text", prompt=IDS, worker="rollout:0", meta={"q": "abc"},
               samples=[Sample(tokens=IDS, logprobs=LOGP, reward=0.5, finish_reason="stop", seed=7,
                               spans=[(0, 1), (3, 2)])]),
    RoutingTrace(**META, group_id="0-0-1", experts=[Tensor.from_numpy(np.zeros((9, 2, 2), np.uint8))]),
    RoutingTrace(**META, group_id="0-0-2", blob=REF),
    StepCommitted(**META, step=4, version=4, groups=["a", "b"], dropped=[DroppedGroup("c", "stale")], loss=-0.1,
                  grad_norm=1.5, weights_sha256="f" * 64, timing=StepTiming(0.1, 0.2, 0.01),
                  metrics={"kl_k3": 1e-4}, staleness={0: 10, 1: 3}, checkpoint=REF),
    GroupsDropped(**META, step=4, dropped=[DroppedGroup("c", "invalid: sample 0 has a non-finite logprob")]),
    WorkerStats(**META, worker="rollout:0", tokens_per_s=100.0, running=3, waiting=1, policy_version=4,
                groups_published=9, idle_share=0.25),
    RunFinished(**META, reason="completed"),
    CheckpointsPruned(**META, steps=[2, 4], after_step=10, keep_last=2, keep_every=20),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: AnyEvent) -> None:
    assert decode(encode(event)) == event
    assert type(event) in STREAM_OF
    assert event_key(event) == ("rollout:0", 3)


def test_tensor_views_are_zero_copy_and_typed() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_numpy(array)
    view = t.numpy()
    assert view.base is not None and not view.flags.writeable  # a view over the event's bytes
    assert np.array_equal(view, array)
    bf16 = torch.randn(4, 3).to(torch.bfloat16)
    assert torch.equal(Tensor.from_torch(bf16).torch(), bf16)
    with pytest.raises(MalformedEvent, match="needs 60 bytes, has 48"):
        Tensor("float32", [3, 5], t.data).numpy()
    with pytest.raises(MalformedEvent, match="dtype"):
        Tensor("complex64", [1], b"12345678").numpy()


def test_unknown_tag_and_wrong_types_are_malformed() -> None:
    with pytest.raises(MalformedEvent):
        decode(msgspec.msgpack.encode({"type": "from_the_future", "run": "r", "producer": "p", "seq": 0}))
    with pytest.raises(MalformedEvent):
        decode(msgspec.msgpack.encode({"type": "run_finished", "run": "r", "producer": "p", "seq": "0",
                                       "reason": "x"}))


def test_new_fields_have_defaults_so_old_bytes_still_decode() -> None:
    old = msgspec.msgpack.encode({"type": "run_started", "run": "r", "producer": "p", "seq": 0, "config_toml": "",
                                  "seed": 0, "code_version": "", "model_config": {}})
    event = decode(old)
    assert isinstance(event, RunStarted) and event.init_reward is None and event.config_hash == ""


def test_stream_keys_share_a_cluster_slot() -> None:
    assert stream_key("run1", "steps") == "reel:{run1}:steps"


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_decode_of_arbitrary_bytes_raises_only_malformed_event(data: bytes) -> None:
    try:
        decode(data)
    except MalformedEvent:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EVENTS), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_decode_of_corrupted_events_raises_only_malformed_event(event: AnyEvent, where: int, value: int) -> None:
    data = bytearray(encode(event))
    data[where % len(data)] = value
    try:
        decode(bytes(data))
    except MalformedEvent:
        pass
