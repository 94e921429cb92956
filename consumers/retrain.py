"""Offline re-training: train a new policy from an old run's logged rollouts, no Redis needed.

`reel retrain --from runs/A --out runs/B` reads A's Trajectory and RoutingTrace events from A's
log and, by default, gives step s of B the groups of A's step s, from A's initial weights, with
the logged inference logprobs as the behaviour policy. B is written as a normal run (config.toml,
init/, blobs/, a log with the groups it used, WeightsPublished and StepCommitted), so `reel replay`
works on it. B's blob store keeps what `reel run`'s would (bus/retention.py, the policy of B's config):
the checkpoints and the window of newest weight versions; replay re-derives the rest. With no override
B's weights equal A's bit for bit at every step: the same `train_step` on the same inputs. `--rescore` first scores every logged sample again with B's env
reward (say another env.options.reward in --config; producers/envs/rescore.py, single-turn samples),
and B's log holds the groups with their new rewards. `--ranks N` trains B on N ranks (this command starts itself again
under torchrun; rank 0 writes B, the others follow); B's commits record that world size.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, RunStarted, StepCommitted, StepTiming, Trajectory, WeightsPublished, encode
from reel.bus.run_log import RunLog
from reel.bus.retention import Retention, RetentionPolicy
from reel.runtime.config import run as config_mod
from reel.runtime.train import distributed, torchrun
from reel.runtime.train.batch import build_batch
from reel.runtime.config.sections import Config
from reel.runtime.config.overrides import apply_sets, parse_sets
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.initial_policy import code_version, init_dir
from reel.runtime.model.weights import load, save
from reel.runtime.train.step import TrainState
from reel.runtime.train.trainer_group import TrainerGroup, run_as_group

PRODUCER = "retrain:0"
# What `--rescore` needs from the envs: config -> (Trajectory -> Trajectory with rewards from config's env).
# Passed in by `reel retrain` (runtime/launch/retrain_cli.py): consumers/ never import producers/.
Rescorer = Callable[[Config], Callable[[Trajectory], Trajectory]]


class RetrainError(ReelError):
    """A source run or option that retraining cannot use."""


def main(args: argparse.Namespace, rescorer: Rescorer | None = None) -> int:
    source, out = Path(args.from_dir), Path(args.out)
    config = _config(source, args.config, out.name, args.set)
    if out.exists():
        raise RetrainError(f"{out} already exists; choose a new --out directory")
    world = distributed.from_env()
    if args.ranks < 1:
        raise RetrainError(f"--ranks {args.ranks} must be at least 1")
    if args.ranks > 1 and not world.distributed:
        return torchrun.relaunch(args.ranks, _argv(args), config.trainer.threads or 1)
    return run_as_group(world, out, config, lambda group: _retrain(args, source, out, config, group, rescorer))


def _argv(args: argparse.Namespace) -> list[str]:
    """The same `reel retrain` command line, to start again on every rank."""
    argv = ["retrain", "--from", args.from_dir, "--out", args.out, "--epochs", str(args.epochs),
            "--ranks", str(args.ranks)]
    for flag, value in (("--config", args.config), ("--steps", args.steps), ("--shuffle", args.shuffle),
                        ("--init", args.init)):
        argv += [flag, str(value)] if value is not None else []
    for item in args.set or []:
        argv += ["--set", item]
    argv += ["--rescore"] if args.rescore else []
    return argv


def _retrain(args: argparse.Namespace, source: Path, out: Path, config: Config, group: TrainerGroup,
             rescorer: Rescorer | None) -> int:
    with RunLog(source, readonly=True) as source_log:
        commits = [e for _, e in source_log.events("steps") if isinstance(e, StepCommitted)]
        if not commits:
            raise RetrainError(f"{source} has no committed steps in its log; nothing to retrain from")
        lookup = GroupLookup.from_log(source_log, BlobStore(source / "blobs"))
    if args.rescore:
        if rescorer is None:
            raise RetrainError("--rescore needs the envs' rescorer; run it as `reel retrain`")
        rescore = rescorer(config)
        # The trained groups, read once through the log index and kept re-scored in memory.
        trained = {g for c in commits for g in c.groups}
        lookup.trajectories = {g: rescore(t) for g in trained if (t := lookup.trajectory(g)) is not None}
    schedule = list(_schedule(commits, config, args.epochs, args.shuffle))
    if args.steps is not None:
        schedule = schedule[:args.steps]
    torch.set_num_threads(config.trainer.threads or 1)
    _build(out, config, _init_source(source, args.init), schedule, lookup, group)
    print(f"retrained {len(schedule)} steps from {source} into {out}" +
          f" on {group.world.size} ranks" * (group.world.size > 1))
    return 0


def _config(source: Path, override: str | None, name: str, sets: list[str] | None = None) -> Config:
    try:
        text = (source / "config.toml").read_text()
    except FileNotFoundError:
        raise RetrainError(f"{source} is not a Reel run directory (no config.toml); pass --from RUN_DIR") from None
    raw = tomllib.loads(text)
    if override:
        try:
            extra = tomllib.loads(Path(override).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RetrainError(f"cannot read --config {override}: {exc}") from exc
        for section, keys in extra.items():
            if not isinstance(keys, dict):
                raise RetrainError(f"--config {override}: {section} must be a [section] table")
            raw.setdefault(section, {}).update(keys)
    raw = apply_sets(raw, parse_sets(sets))  # --set: after --config, so the command line wins
    raw.setdefault("run", {})["name"] = name
    return config_mod.from_dict(raw, source=override or str(source / "config.toml"))


def _schedule(commits: list[StepCommitted], config: Config, epochs: int,
              shuffle: int | None) -> Iterator[list[str]]:
    """Group ids per step of B: A's commit order, or shuffled into batches of B's batch_groups."""
    if epochs < 1:
        raise RetrainError(f"--epochs {epochs} must be at least 1")
    ordered = sorted(commits, key=lambda c: c.step)
    for epoch in range(epochs):
        if shuffle is None:
            yield from (c.groups for c in ordered)
            continue
        groups = [g for c in ordered for g in c.groups]
        random.Random(f"{shuffle}-{epoch}").shuffle(groups)
        size = config.trainer.batch_groups
        yield from (groups[i:i + size] for i in range(0, len(groups) - size + 1, size))


def _init_source(source: Path, init: str | None) -> Path:
    path = Path(init) if init else init_dir(source)
    if not (path / "config.json").is_file():
        raise RetrainError(f"no initial weights at {path} (config.json missing); pass --init DIR")
    return path


def _build(out: Path, config: Config, init: Path, schedule: list[list[str]], lookup: GroupLookup,
           group: TrainerGroup) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "config.toml").write_text(config_mod.to_toml(config))
        save(load(init), init_dir(staging))
        group.run_dir = staging  # DCP checkpoints go under B's directory
        writer = _RunWriter(staging, config, group)
        state = group.initial_state(init_dir(staging))
        writer.start(state)
        for i, step_groups in enumerate(schedule):
            writer.copy_groups(step_groups, lookup)
            state = writer.step(state, step_groups, lookup, last=i == len(schedule) - 1)
        writer.close()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class _RunWriter:
    """Writes B's log and blobs exactly as the online trainer and archiver would have."""

    def __init__(self, run_dir: Path, config: Config, group: TrainerGroup):
        self.config = config
        self.group = group
        self.run = config.run.name
        self.blobs = BlobStore(run_dir / "blobs")
        self.retention = Retention(RetentionPolicy.of(config.rollout.async_level, config.trainer.max_off_policy_steps,
                                                      config.log.keep_weights_every), self.blobs)
        self.log = RunLog(run_dir)
        self.seq = 0
        self.entry = 0
        self.copied: set[str] = set()

    def _stamp(self, cls: type, **fields: object) -> AnyEvent:
        event = cls(run=self.run, producer=PRODUCER, seq=self.seq, **fields)
        self.seq += 1
        return event

    def _append(self, stream: str, events: list[AnyEvent]) -> None:
        records = []
        for event in events:
            self.entry += 1
            records.append((f"{self.entry}-0", encode(event)))
        self.log.stream(stream).append_batch(records)

    def start(self, state: TrainState) -> None:
        config_text = config_mod.to_toml(self.config)
        self._append("control", [self._stamp(
            RunStarted, config_toml=config_text, seed=self.config.run.seed, code_version=code_version(),
            model_config=state.model.config.to_hf_dict(), config_hash=config_mod.config_hash(self.config))])
        published = self._stamp(WeightsPublished, version=0, step=0, weights=self.blobs.put(self.group.weights(state)))
        self._append("weights", [published])
        self.retention.add([published])

    def copy_groups(self, group_ids: list[str], lookup: GroupLookup) -> None:
        """B's log holds the groups it trained on (original events, routing blobs re-stored in B)."""
        new = [g for g in group_ids if g not in self.copied]
        trajectories = [t for t in map(lookup.trajectory, new) if t is not None]
        traces = [t for t in map(lookup.trace, new) if t is not None]
        for trace in traces:
            if trace.blob is not None:
                self.blobs.put(lookup.blobs.get(trace.blob))
        self._append("trajectories", trajectories)
        self._append("routing", traces)
        self.copied.update(new)

    def step(self, state: TrainState, group_ids: list[str], lookup: GroupLookup, *, last: bool) -> TrainState:
        batch = build_batch([lookup.group(g, where=f"step {state.step + 1} of the retrain") for g in group_ids])
        started = time.perf_counter()
        state, result = self.group.step(state, batch)
        compute = time.perf_counter() - started
        ref = self.blobs.put(self.group.weights(state))
        ckpt = None
        if state.step % self.config.trainer.checkpoint_every == 0 or last:
            ckpt = self.blobs.put(self.group.checkpoint(state))
        published = self._stamp(WeightsPublished, version=state.step, step=state.step, weights=ref)
        self._append("weights", [published])
        commit = self._stamp(
            StepCommitted, step=state.step, version=state.step, groups=group_ids, dropped=[], loss=result.loss,
            grad_norm=result.grad_norm, weights_sha256=result.weights_sha256,
            timing=StepTiming(wait=0.0, compute=compute, publish=0.0), metrics=result.metrics,
            staleness=result.staleness, checkpoint=ckpt, config_hash=config_mod.config_hash(self.config),
            code_version=code_version(), world_size=self.group.world.size)
        self._append("steps", [commit])
        self.retention.add([published, commit])
        self.retention.collect()  # as the trainer does after each commit
        return state

    def close(self) -> None:
        self.log.close()
