"""Shared by several tests (was test_partitions.py's)."""

from __future__ import annotations
import numpy as np
from reel.bus.events import (RoutingTrace, Sample, Tensor, Trajectory)
from reel.bus.partitions import worker_partition
from reel.bus.streams import Publisher


P = 3

def publish_group(publisher: Publisher, i: int) -> list:
    tokens = Tensor.from_numpy(np.arange(i % 7 + 1, dtype=np.int32))
    sample = Sample(tokens=tokens, logprobs=Tensor.from_numpy(np.zeros(i % 7 + 1, np.float32)), reward=1.0,
                    finish_reason="stop", seed=i, spans=[(0, 0)])
    group_id = f"{publisher.producer}-{i}"
    return [publisher.stamp(Trajectory, group_id=group_id, env="e", prompt=tokens, samples=[sample] * 2,
                            worker=publisher.producer),
            publisher.stamp(RoutingTrace, group_id=group_id,
                            experts=[Tensor.from_numpy(np.zeros((2, 1, 1), np.uint8))] * 2)]

def worker_publishers(client, run: str) -> list[Publisher]:
    return [Publisher(client, run, f"rollout:{w}", partition=worker_partition(w, P)) for w in range(P)]
