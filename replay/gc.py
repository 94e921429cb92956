"""`reel log gc --run DIR`: apply the retention policies (bus/retention.py) to a run: weight versions,
and checkpoints under log.keep_checkpoints / log.keep_checkpoints_every.

For runs written before the trainer applied them, or with other `log.*` keys now in config.toml.
Only the run's blobs/ (and checkpoints/) is touched: a Mooncake store lives no longer than its run.
The weight window is counted back from the newest version in the log, which is never ahead of a
live trainer's, so on a running run this deletes nothing the trainer would keep. Checkpoints are
pruned only on a run that is not running (its log is not open for writing): gc appends the
CheckpointsPruned to the log itself, before deleting, as the trainer would publish it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import CheckpointsPruned, encode
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.logformat import entry_order
from reel.bus.retention import CheckpointPolicy, Retention, RetentionPolicy
from reel.bus.seqs import next_seq_in_log
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load_run_config

PRODUCER = "gc:0"  # CheckpointsPruned appended by `reel log gc` (the trainer's are "trainer:0")


def run_retention(run_dir: Path, config: Config) -> Retention:
    """The run's versions and checkpoints as its log names them, under its config's policies."""
    policy = RetentionPolicy.of(config.rollout.async_level, config.trainer.max_off_policy_steps,
                                config.log.keep_weights_every)
    retention = Retention(policy, BlobStore(run_dir / "blobs"),
                          CheckpointPolicy(config.log.keep_checkpoints, config.log.keep_checkpoints_every),
                          delete_files=lambda step: _delete_sharded(run_dir, step))
    with RunLog(run_dir, readonly=True) as run_log:
        for stream in ("weights", "steps", "control"):
            if stream in run_log.names():
                retention.add([event for _, event in run_log.events(stream)])
    return retention


def _delete_sharded(run_dir: Path, step: int) -> int:
    from reel.runtime.checkpoint import sharded  # torch: only for an N-rank run's checkpoint

    return sharded.delete_files(run_dir, step)


def gc(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    config = load_run_config(run_dir)
    retention = run_retention(run_dir, config)
    policy = retention.policy
    every = f", and every {policy.keep_every}th" if policy.keep_every else ""
    rule = f"keeps the newest {policy.window} weight versions{every}, {_checkpoint_rule(config)} and init/"
    doomed_checkpoints = retention.doomed_checkpoints()
    if args.dry_run:
        doomed = [v.version for v in retention.doomed()]
        print(f"would delete {len(doomed)} weight versions{_listing(doomed)} and {len(doomed_checkpoints)} "
              f"checkpoints{_listing(doomed_checkpoints)} of {run_dir} (the policy {rule})")
        return 0
    if doomed_checkpoints:
        retention.add([_record_pruning(run_dir, config, retention, doomed_checkpoints)])
    deleted, freed = retention.collect()
    print(f"deleted {len(deleted)} weight versions{_listing(deleted)} and {len(doomed_checkpoints)} "
          f"checkpoints{_listing(doomed_checkpoints)} of {run_dir}, {freed / 1e6:.1f} MB freed (the policy {rule}); "
          f"replay re-derives the versions from the checkpoints")
    if doomed_checkpoints:
        kept = sorted(retention.checkpoints)
        print(f"steps after {kept[0]} (the oldest checkpoint kept) replay bit for bit; `reel replay step N` names "
              f"the checkpoint an earlier one would need; every trajectory stays in the log (`reel retrain`)")
    return 0


def _record_pruning(run_dir: Path, config: Config, retention: Retention, steps: list[int]) -> CheckpointsPruned:
    """Append the CheckpointsPruned to the log's control stream (after its last entry, at this time: a
    later entry of a resumed run comes after it). Raises LogError while the run's archiver holds the log."""
    policy = retention.checkpoint_policy
    seq = next_seq_in_log(run_dir, PRODUCER, ["control"])
    event = CheckpointsPruned(run=config.run.name, producer=PRODUCER, seq=seq, steps=steps,
                              after_step=max(retention.checkpoints), keep_last=policy.keep_last,
                              keep_every=policy.keep_every)
    try:
        with RunLog(run_dir) as run_log:
            stream = run_log.stream("control")
            last = stream.last_entry_id()
            ms = max(int(time.time() * 1000), entry_order(last)[0] + 1 if last else 0)
            stream.append_batch([(f"{ms}-0", encode(event))])
    except LogError as exc:
        raise LogError(f"{exc}; checkpoints are pruned by `reel log gc` only on a run that is not running (a running "
                       f"trainer prunes them itself under log.keep_checkpoints)") from exc
    return event


def _checkpoint_rule(config: Config) -> str:
    keep, every = config.log.keep_checkpoints, config.log.keep_checkpoints_every
    if keep <= 0:
        return "every checkpoint (log.keep_checkpoints = 0)"
    return f"the newest {keep} checkpoints" + (f" and those of steps divisible by {every}" if every else "")


def _listing(versions: list[int]) -> str:
    if not versions:
        return ""
    if versions == list(range(versions[0], versions[-1] + 1)):
        return f" ({versions[0]}..{versions[-1]})" if len(versions) > 1 else f" ({versions[0]})"
    return f" ({', '.join(map(str, versions[:8]))}{', ...' if len(versions) > 8 else ''})"
