"""One logical trainer over N ranks: rank 0 drives, ranks > 0 follow.

Only rank 0 talks to the bus (reads groups, commits, acks). Everything that touches the model is a
collective, so rank 0 announces each call to the other ranks before making it itself, and they
make the same call in `follow`:

    init      version 0 from an HF directory            restore   a checkpoint blob (b"" = version 0)
    step      train_step on a batch (sent whole)          save      a checkpoint
    weights   gather the full weights                     stop      leave `follow`
    publish   write this rank's shards of a version (runtime/weights/rank_publish.py)

An announcement is one broadcast of msgpack [op, run directory, argument, payload] (a batch
travels as safetensors): no pickle on the wire. On one process every call is a plain function call.
A rank that dies (kill -9) breaks the next collective on the others: the group stops as a whole
(torchrun ends the rest) and rank 0's commit protocol decides what was trained.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from reel.runtime.train.batch import Batch
from reel.runtime.config.sections import Config
from reel.bus.blobs import BlobBackend
from reel.bus.events import BlobRef
from reel.runtime.blob_store import run_blobs
from reel.runtime.train.distributed import World, broadcast_bytes, shutdown
from reel.runtime.train.reexecute import initial_state, restored_state, save_checkpoint
from reel.runtime.train.step import StepResult, TrainState, full_weights, train_step
from reel.runtime.weights.rank_publish import RankPublisher
from reel.runtime.weights.digest import PIECES

log = logging.getLogger("reel.trainer")
INIT, RESTORE, STEP, SAVE, WEIGHTS, PUBLISH, STOP = "init", "restore", "step", "save", "weights", "publish", "stop"


class TrainerGroup:
    """Rank 0's handle on every rank of the trainer (a plain function call on one process)."""

    world: World
    run_dir: Path
    config: Config
    publisher: RankPublisher  # rank 0's own shards of the newest version (a delta's base)

    def __init__(self, world: World, run_dir: Path, config: Config):
        self.world = world
        self.run_dir = run_dir
        self.config = config
        self.publisher = RankPublisher(world, config)

    def initial_state(self, init: Path | None = None) -> TrainState:
        self._announce(INIT, str(init or ""))
        return initial_state(self.run_dir, self.config, self.world, init)

    def restore(self, data: bytes, source: str) -> TrainState:
        """Version 0 with the checkpoint blob `data` loaded (b"": version 0 itself)."""
        self._announce(RESTORE, source, data)
        return restored_state(self.run_dir, self.config, self.world, data, source)

    def step(self, state: TrainState, batch: Batch, *, digest: str = PIECES) -> tuple[TrainState, StepResult]:
        """`digest` is the weights digest's scheme (runtime/weights/digest.py)."""
        self._announce(STEP, digest, batch_bytes(batch) if self.world.distributed else b"")
        return train_step(state, batch, self.config, self.world, digest=digest)

    def checkpoint(self, state: TrainState) -> bytes:
        self._announce(SAVE)
        return save_checkpoint(state, self.world, self.run_dir)

    def weights(self, state: TrainState) -> bytes:
        self._announce(WEIGHTS)
        return full_weights(state.model, self.world)

    def publish(self, state: TrainState, blobs: BlobBackend) -> tuple[BlobRef, str]:
        """Writes policy version `state.step` to `blobs`: (WeightsPublished.weights, .format). Every rank
        writes its own shards; rank 0 names them (the followers write to the run's store, `run_blobs`)."""
        if self.config.trainer.weight_format == "safetensors":
            return blobs.put(self.weights(state)), "safetensors"
        self._announce(PUBLISH)
        published = self.publisher.publish(state.model, state.step, blobs)
        assert published is not None  # rank 0 names the version
        return published[0], "manifest"

    def close(self) -> None:
        self._announce(STOP)

    def _announce(self, op: str, argument: str = "", payload: bytes = b"") -> None:
        if self.world.distributed:
            message = [op, str(self.run_dir), argument, payload]
            broadcast_bytes(self.world, msgspec.msgpack.encode(message))


def run_as_group(world: World, run_dir: Path, config: Config, lead: Callable[[TrainerGroup], int]) -> int:
    """Rank 0 runs `lead` with the group's handle; the other ranks follow until it is done."""
    every_rank_done = False
    try:
        if world.rank > 0:
            follow(world, config)
            every_rank_done = True
            return 0
        group = TrainerGroup(world, run_dir, config)
        try:
            return lead(group)
        finally:
            try:
                group.close()
                every_rank_done = True
            except RuntimeError as exc:  # a rank already gone: torchrun stops the rest
                log.warning("could not tell the other trainer ranks to stop: %s", exc)
    finally:
        shutdown(world, drain=every_rank_done)


def follow(world: World, config: Config) -> None:
    """Ranks > 0: make every call rank 0 announces, until it says stop."""
    state: TrainState | None = None
    publisher = RankPublisher(world, config)
    blobs: BlobBackend | None = None  # the run's store, opened at the first publish
    while True:
        op, directory, argument, payload = msgspec.msgpack.decode(broadcast_bytes(world, None))
        run_dir = Path(directory)
        if op == INIT:
            state = initial_state(run_dir, config, world, Path(argument) if argument else None)
        elif op == RESTORE:
            state = restored_state(run_dir, config, world, payload, argument)
        elif op == STOP:
            return
        else:
            assert state is not None, f"rank {world.rank} got {op!r} before any state"
            if op == STEP:
                state, _ = train_step(state, batch_from_bytes(payload), config, world, digest=argument)
            elif op == SAVE:
                save_checkpoint(state, world, run_dir)
            elif op == WEIGHTS:
                full_weights(state.model, world)
            elif op == PUBLISH:
                blobs = blobs or run_blobs(run_dir, config)
                publisher.publish(state.model, state.step, blobs)


def batch_bytes(batch: Batch) -> bytes:
    """A Batch as safetensors: its tensors by field name, the rest (group ids) as JSON metadata."""
    tensors = {k: v.contiguous() for k, v in batch._asdict().items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in batch._asdict().items() if not isinstance(v, torch.Tensor) and v is not None}
    return st_save(tensors, metadata={"rest": json.dumps(rest)})


def batch_from_bytes(data: bytes) -> Batch:
    tensors = st_load(data)
    header_len = int.from_bytes(data[:8], "little")
    rest = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["rest"])
    return Batch(**{name: tensors.get(name, rest.get(name)) for name in Batch._fields})
