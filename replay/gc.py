"""`reel log gc --run DIR`: apply the weight-version retention policy (bus/retention.py) to a run.

For runs written before the trainer applied it, or with another `log.keep_weights_every` now in
config.toml. Only the run's blobs/ is touched: a Mooncake store lives no longer than its run. The
window is counted back from the newest version in the log, which is never ahead of a live
trainer's, so on a running run this deletes nothing the trainer would keep.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reel.bus.blob_backends.file import BlobStore
from reel.bus.log import RunLog
from reel.bus.retention import Retention, RetentionPolicy
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load_run_config


def run_retention(run_dir: Path, config: Config) -> Retention:
    """The run's versions and checkpoints as its log names them, under its config's policy."""
    policy = RetentionPolicy.of(config.rollout.async_level, config.trainer.max_off_policy_steps,
                                config.log.keep_weights_every)
    retention = Retention(policy, BlobStore(run_dir / "blobs"))
    with RunLog(run_dir, readonly=True) as run_log:
        for stream in ("weights", "steps"):
            if stream in run_log.names():
                retention.add([event for _, event in run_log.events(stream)])
    return retention


def gc(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    retention = run_retention(run_dir, load_run_config(run_dir))
    policy = retention.policy
    every = f", and every {policy.keep_every}th" if policy.keep_every else ""
    rule = f"keeps the newest {policy.window} weight versions{every}, every checkpoint and init/"
    if args.dry_run:
        doomed = [v.version for v in retention.doomed()]
        print(f"would delete {len(doomed)} weight versions{_listing(doomed)} of {run_dir} (the policy {rule})")
        return 0
    deleted, freed = retention.collect()
    print(f"deleted {len(deleted)} weight versions{_listing(deleted)} of {run_dir}, {freed / 1e6:.1f} MB freed "
          f"(the policy {rule}); replay re-derives them from the checkpoints")
    return 0


def _listing(versions: list[int]) -> str:
    if not versions:
        return ""
    if versions == list(range(versions[0], versions[-1] + 1)):
        return f" ({versions[0]}..{versions[-1]})" if len(versions) > 1 else f" ({versions[0]})"
    return f" ({', '.join(map(str, versions[:8]))}{', ...' if len(versions) > 8 else ''})"
